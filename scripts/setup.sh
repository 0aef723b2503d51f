#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install Tasklet into it.
# torch is installed first and pinned: an unpinned `torch` from PyPI pulls the multi-GB CUDA build.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# The multi-host test bed (peer/emulation/netbed.py) needs `ip` and `nft`; as root on Debian, install them when missing.
# Quiet and tolerant: when apt fails, those tests skip with the reason. SKIP_APT=1 leaves the system alone.
if [ "$(id -u)" -eq 0 ] && [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null \
   && ! { command -v nft && command -v ip && command -v tc; } >/dev/null 2>&1; then
  echo "[setup] installing nftables and iproute2 for the network-namespace tests" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2; } >/dev/null 2>&1 \
    || echo "[setup] apt-get could not install nftables/iproute2; the network-namespace tests will skip" >&2
fi
# The dashboard test renders the page in headless Chromium; as root on Debian, install it when missing
# (tolerant like the above: without it that test skips with the reason).
if [ "$(id -u)" -eq 0 ] && [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null \
   && ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium for the dashboard test" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "[setup] apt-get could not install chromium; the dashboard's browser test will skip" >&2
fi
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC" >&2
  # shellcheck disable=SC2086
  pip_q $TORCH_SPEC
fi
pip_q -e '.[dev]'
"$VENV/bin/python" -c 'import torch, hivemind, grpc, scheduler, peer, protocol' \
  || { echo "[setup] FAILED: the virtualenv $VENV cannot import Tasklet's dependencies" >&2; exit 1; }
