"""GPU checks are scripts (``check_*.py``) that also run under pytest: collect them as test modules.

Each prints its figures as one JSON line when run by hand on a GPU machine; under pytest its
``gpu``-marked tests are skipped where there is no CUDA GPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest


def pytest_collect_file(parent, file_path):
    if file_path.suffix == ".py" and file_path.name.startswith("check_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
