#!/usr/bin/env bash
# The project's test command: install the tests' system tools, set up .venv, lint, run the whole test suite.
# Two pytest-xdist workers by default (TASKLET_TEST_WORKERS; 0 runs one process): tests/conftest.py puts every test
# that starts processes on one worker, one at a time (two swarms at once on 2 cores only wait on each other), and
# the in-process tests on the other, beside them (docs/measurements.md, "The test suite").
# pytest's exit status 5 ("no tests collected") is turned into a failure: a suite that runs nothing is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-test-tools.sh  # system tools some tests need (apt-get, as root); skipped tests say which
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
