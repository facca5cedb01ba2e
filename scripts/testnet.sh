#!/usr/bin/env bash
# The main job: install (if needed), then run the local testnet on CPU with its embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/veriroll testnet "$@"
