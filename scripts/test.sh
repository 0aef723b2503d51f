#!/usr/bin/env bash
# The project's test command: set up .venv, lint, run the whole test suite.
# One process by default. TASKLET_TEST_WORKERS=N runs N pytest-xdist workers (tests/conftest.py keeps the namespace
# bed's and the container engine's tests on one worker each); on 2 cores that was slower, not faster: the swarm
# tests' peers already use every core (docs/measurements.md, "The test suite").
# pytest's exit status 5 ("no tests collected") is turned into a failure: a suite that runs nothing is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest -n "${TASKLET_TEST_WORKERS:-0}" --dist loadgroup "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "FAILED: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
