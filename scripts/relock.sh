#!/usr/bin/env bash
# Refresh every lock from pyproject.toml: requirements/dev-cpu.txt (what setup.sh installs for development and
# CI, hashed), requirements/test-model.txt, and the images' deploy/requirements-{cpu,gpu}.txt derived from it.
# The one place versions move: run it after changing pyproject.toml's requirements (or to take newer
# releases), then `bash scripts/test.sh` and commit the locks with the change. Needs the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # the lock's own uv does the resolving
.venv/bin/python -m veriroll.deploy.lock "${1:-all}"
bash scripts/setup.sh  # and this venv becomes the new lock
git --no-pager diff --stat -- requirements deploy/requirements-cpu.txt deploy/requirements-gpu.txt || true
