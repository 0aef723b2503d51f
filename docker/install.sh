#!/usr/bin/env bash
# Install Tasklet into a virtualenv: the install steps of both images (docker/Dockerfile, docker/Dockerfile.cpu),
# kept in one script so that tests/project/test_docker.py runs exactly what an image build runs.
#
#   VENV         virtualenv to create or reuse                   (default /opt/tasklet)
#   SRC          the project's source tree                       (default: the folder above this script)
#   PYTHON       interpreter that creates the virtualenv         (default python3)
#   TORCH_SPEC   torch requirement, installed first and pinned   (default torch==2.13.0)
#   TORCH_INDEX  wheel index for torch; empty = the configured one (PyPI: on Linux that is the CUDA build)
#   STEP         deps: torch and the dependencies pyproject.toml lists, not Tasklet (an image layer that stays
#                cached until pyproject.toml or this script changes); wheel: build Tasklet's wheel into WHEELS;
#                project: Tasklet (after deps; the wheel in WHEELS when that is set, else SRC); all: deps and
#                project                                          (default all)
#   WHEELS       folder of Tasklet's wheel (STEP=wheel writes it, STEP=project installs it)   (default empty)
#   TORCH_BUILD  cpu: fail unless the installed torch is a CPU build; cuda: fail unless it is a CUDA build;
#                empty: either                                    (default empty)
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
TORCH_BUILD=${TORCH_BUILD:-}
STEP=${STEP:-all}
WHEELS=${WHEELS:-}
case $STEP in deps | wheel | project | all) ;; *) echo "[install] STEP must be deps, wheel, project or all, not '$STEP'" >&2; exit 2 ;; esac
if [ "$STEP" = wheel ] && [ -z "$WHEELS" ]; then echo "[install] STEP=wheel needs WHEELS, the folder to write to" >&2; exit 2; fi
case $TORCH_BUILD in "" | cpu | cuda) ;; *) echo "[install] TORCH_BUILD must be cpu, cuda or empty, not '$TORCH_BUILD'" >&2; exit 2 ;; esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating virtualenv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --no-cache-dir --disable-pip-version-check "$@"; }
# Which torch arrived is checked, not assumed: an index that lacks the wanted build falls back to another one
# (PyPI's Linux wheel is the multi-GB CUDA build; a local +cpu wheel satisfies torch==X too) without a word.
check_torch() {
  local cuda
  cuda=$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "none")')
  if [ "$TORCH_BUILD" = cpu ] && [ "$cuda" != none ]; then
    echo "[install] FAILED: wanted a CPU torch, got a CUDA $cuda build (check TORCH_SPEC/TORCH_INDEX)" >&2; exit 1
  fi
  if [ "$TORCH_BUILD" = cuda ] && [ "$cuda" = none ]; then
    echo "[install] FAILED: wanted a CUDA torch, got a CPU build (check TORCH_SPEC/TORCH_INDEX)" >&2; exit 1
  fi
}

if [ "$STEP" = deps ] || [ "$STEP" = all ]; then
  echo "[install] $TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX}" >&2
  if [ -n "$TORCH_INDEX" ]; then
    pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX"
  else
    pip_install "$TORCH_SPEC"
  fi
  check_torch
  echo "[install] the dependencies in $SRC/pyproject.toml" >&2
  "$VENV/bin/python" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
    "$SRC/pyproject.toml" >"$VENV/tasklet-requirements.txt"
  # the torch just installed stays: a requirement it satisfies installs nothing more
  pip_install -r "$VENV/tasklet-requirements.txt"
  rm -f "$VENV/tasklet-requirements.txt"
fi
if [ "$STEP" = deps ]; then
  echo "[install] done: dependencies only" >&2
  exit 0
fi
if [ "$STEP" = wheel ]; then
  # The image's runtime stage installs this wheel on top of the dependencies' stage: no compiler there, and a
  # change to Tasklet's code adds a layer of a few MB instead of a second copy of the whole virtualenv.
  echo "[install] building Tasklet's wheel from $SRC into $WHEELS" >&2
  "$VENV/bin/python" -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps -w "$WHEELS" "$SRC"
  echo "[install] done: $(cd "$WHEELS" && ls tasklet-*.whl)" >&2
  exit 0
fi
if [ -n "$WHEELS" ]; then
  wheel=$(find "$WHEELS" -maxdepth 1 -name 'tasklet-*.whl' | sort | tail -n 1)
  if [ -z "$wheel" ]; then echo "[install] no tasklet-*.whl in $WHEELS (run STEP=wheel first)" >&2; exit 1; fi
  echo "[install] tasklet from $wheel" >&2
  pip_install --no-deps "$wheel"
else
  echo "[install] tasklet from $SRC" >&2
  pip_install "$SRC"
fi

# Fail the build here, not on a volunteer's machine: every import the daemon needs, and the entry point.
"$VENV/bin/python" -c 'import torch, hivemind, grpc, tasklet.scheduler, tasklet.peer, tasklet.protocol'
"$VENV/bin/peer" --help >/dev/null
check_torch
echo "[install] done: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')" >&2
