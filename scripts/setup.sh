#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv (.venv, or $VENV) and install Tasklet into it. It changes nothing
# outside the checkout but pip's own download cache: no system package, nothing under /etc or /usr/local, root or
# not (scripts/demo.sh runs only this). The system tools only the test suite needs are scripts/setup-test-tools.sh.
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
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC" >&2
  # shellcheck disable=SC2086
  pip_q $TORCH_SPEC
fi
pip_q -e '.[dev]'
# compose for podman (>= 1.6: earlier ones start one replica of a service whatever deploy.replicas says)
if command -v podman >/dev/null && [ ! -x "$VENV/bin/podman-compose" ]; then
  pip_q 'podman-compose>=1.6'
fi
"$VENV/bin/python" -c 'import torch, hivemind, grpc, tasklet.scheduler, tasklet.peer, tasklet.protocol' \
  || { echo "[setup] FAILED: the virtualenv $VENV cannot import Tasklet's dependencies" >&2; exit 1; }
