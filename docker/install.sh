#!/usr/bin/env bash
# Install Tasklet into a virtualenv: the install steps of both images (docker/Dockerfile, docker/Dockerfile.cpu),
# kept in one script so that tests/test_docker.py runs exactly what an image build runs.
#
#   VENV         virtualenv to create or reuse                   (default /opt/tasklet)
#   SRC          the project's source tree                       (default: the folder above this script)
#   PYTHON       interpreter that creates the virtualenv         (default python3)
#   TORCH_SPEC   torch requirement, installed first and pinned   (default torch==2.13.0)
#   TORCH_INDEX  wheel index for torch; empty = the configured one (PyPI: on Linux that is the CUDA build)
#
# torch goes first and pinned because `pip install .` would otherwise resolve an unpinned torch itself: on
# Linux that is PyPI's multi-GB CUDA build, even in the CPU image. Nothing is cached (--no-cache-dir): the
# image only needs what is installed.
set -euo pipefail
VENV=${VENV:-/opt/tasklet}
SRC=${SRC:-$(cd "$(dirname "$0")/.." && pwd)}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating virtualenv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check "$@"; }

echo "[install] $TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX}" >&2
if [ -n "$TORCH_INDEX" ]; then
  pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX"
else
  pip_install "$TORCH_SPEC"
fi
echo "[install] tasklet from $SRC" >&2
pip_install "$SRC"

# Fail the build here, not on a volunteer's machine: every import the daemon needs, and the entry point.
"$VENV/bin/python" -c 'import torch, hivemind, grpc, scheduler, peer, protocol'
"$VENV/bin/peer" --help >/dev/null
echo "[install] done: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')" >&2
