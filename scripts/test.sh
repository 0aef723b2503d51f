#!/usr/bin/env bash
# The project's test command: set up .venv, lint, run the whole test suite.
# pytest's exit status 5 ("no tests collected") is turned into a failure: a suite that runs nothing is broken.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "FAILED: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
