#!/usr/bin/env bash
# The test command: install (if needed), lint, then the whole suite. Slow and GPU tests skip with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# Two workers, each test file on one of them (module fixtures stay in one process): the suite's many
# subprocess and network waits overlap, 605 s -> 375 s of tests on 2 cores. VERIROLL_TEST_WORKERS=0: one process.
workers=${VERIROLL_TEST_WORKERS:-2}
if [ "$workers" -gt 1 ]; then
  .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
else
  .venv/bin/python -m pytest -q "$@"
fi
