#!/usr/bin/env bash
# The test command: install (if needed), lint, then the whole suite. Slow and GPU tests skip with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
