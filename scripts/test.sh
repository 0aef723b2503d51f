#!/usr/bin/env bash
# The project's test command: set up .venv, lint, run the whole test suite.
# Two workers (pytest-xdist; TASKLET_TEST_WORKERS=0 runs in one process): the swarm tests wait on emulated devices
# and links more than they compute, and tests/conftest.py keeps the namespace bed's tests on one worker.
# pytest's exit status 5 ("no tests collected") is turned into a failure: a suite that runs nothing is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -n "${TASKLET_TEST_WORKERS:-2}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "FAILED: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
