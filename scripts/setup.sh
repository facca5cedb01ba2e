#!/usr/bin/env bash
# Create .venv/ in the repository root and install exactly the committed lock into it: veriroll[dev] with the
# CPU build of torch (requirements/dev-cpu.txt, every file hashed) and the real test model
# (requirements/test-model.txt), then veriroll itself as an editable install. Nothing is resolved here, so a
# fresh clone installs the same bytes today and in a month; scripts/relock.sh is the one place versions move.
# Idempotent: installs again only when pyproject.toml or a lock changed since the last run, and then removes
# whatever the lock no longer names.
set -euo pipefail
cd "$(dirname "$0")/.."
locks=(requirements/dev-cpu.txt requirements/test-model.txt)
# The lock is for CPython 3.11 (its CPU torch is a cp311 file): take python3.11 where python3 is another.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null && command -v python3.11 >/dev/null; then
    PYTHON=python3.11
  fi
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup.sh: requirements/dev-cpu.txt is locked for CPython 3.11; $PYTHON is $("$PYTHON" -V 2>&1)." >&2
  echo "  Install Python 3.11 (or set PYTHON=/path/to/python3.11), or relock for yours: scripts/relock.sh" >&2
  exit 2
fi
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "setup.sh: .venv/ holds another Python; making it again"
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.veriroll-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "${locks[0]}" -nt "$stamp" ] || [ "${locks[1]}" -nt "$stamp" ]; then
  # First the lock's build tools (setuptools, wheel): the few locked packages that PyPI has only as source
  # (fastecdsa, ...) are then built with them, not with whatever an isolated build environment would resolve.
  build_tools=$(mktemp)
  awk '/^(setuptools|wheel)==/{p=1} p{print} p && !/\\$/{p=0}' "${locks[0]}" >"$build_tools"
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r "$build_tools"
  rm -f "$build_tools"
  install=(.venv/bin/python -m pip install -q --require-hashes --no-deps --no-build-isolation -r "${locks[0]}" -r "${locks[1]}")
  # The CPU torch (torch==X+cpu) lies in pip's configured sources where the machine keeps it (a local wheel
  # folder or a mirror); elsewhere only PyTorch's CPU index has it. The hashes decide what is accepted.
  log=$(mktemp)
  if ! "${install[@]}" 2>"$log"; then
    echo "setup.sh: the lock did not install from pip's configured sources; trying PyTorch's CPU index for torch"
    "${install[@]}" --extra-index-url https://download.pytorch.org/whl/cpu || { cat "$log" >&2; exit 1; }
  fi
  # veriroll itself, built by the lock's setuptools (no isolated build environment to resolve).
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  rm -f "$log"
  # What an earlier lock installed and this one no longer names goes (pip itself and veriroll stay).
  stale=$(.venv/bin/python - "${locks[@]}" <<'PY'
import sys
from importlib import metadata
from pathlib import Path
sys.path.insert(0, "deploy")
from lock import read_pins  # noqa: E402  (the lock's own reader, without importing veriroll's package)
from packaging.utils import canonicalize_name  # noqa: E402
locked = {name for path in sys.argv[1:] for name in read_pins(Path(path))} | {"pip", "veriroll"}
installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
print(" ".join(sorted(installed - locked)))
PY
)
  if [ -n "$stale" ]; then
    echo "setup.sh: removing what the lock no longer names: $stale"
    # shellcheck disable=SC2086
    .venv/bin/python -m pip uninstall -q -y $stale
  fi
  touch "$stamp"
fi
# bubblewrap, the sandbox that runs model-written code (coordinator/sandbox.py, docs/sandbox.md): Debian's
# package (0.8 or newer), where it is missing and this runs as root with apt-get. Elsewhere the sandbox's
# tests skip and say why, and a sandbox pool refuses to be made there (SandboxUnavailable) unless the
# operator names the weaker mode.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup.sh: installing bubblewrap (apt-get install bubblewrap) for the code sandbox"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1; }; } \
    || echo "setup.sh: bubblewrap could not be installed; the sandbox's tests will skip" >&2
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
