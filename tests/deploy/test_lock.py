"""The images' pinned requirements agree with pyproject.toml and with the environment the tests run in."""

from __future__ import annotations

from packaging.utils import canonicalize_name
from packaging.version import Version

from veriroll.deploy import lock

DEV_ONLY = {"pytest", "pytest-timeout", "hypothesis", "ruff", "grpcio-tools", "matplotlib", "vllm"}


def _satisfied(pins: dict[str, str], requirements: list) -> list[str]:
    missing = []
    for req in requirements:
        version = pins.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(Version(version), prereleases=True):
            missing.append(f"{req} (pinned: {version})")
    return missing


def test_cpu_lock_pins_every_runtime_requirement_within_its_range():
    pins = lock.read_pins(lock.CPU_LOCK)
    assert _satisfied(pins, lock.project_requirements()) == []
    for extra in lock.IMAGE_EXTRAS:  # the scale-out roles' PostgreSQL driver, the nodes' swarm
        assert _satisfied(pins, lock.project_requirements(extra)) == [], extra
    assert pins["torch"].endswith("+cpu"), "the CPU image pins the CPU build of torch"
    assert f"--extra-index-url {lock.CPU_TORCH_INDEX}" in lock.CPU_LOCK.read_text().splitlines()
    assert DEV_ONLY.isdisjoint(pins), "dev tools and extras stay out of the CPU image"


def test_cpu_lock_covers_everything_the_tested_environment_needs_at_run_time():
    # Names only: versions move with the environment (regenerate with `python -m veriroll.deploy.lock cpu`).
    needed, _ = lock.runtime_closure()
    pins = lock.read_pins(lock.CPU_LOCK)
    assert set(needed) - set(pins) == set(), "run `python -m veriroll.deploy.lock cpu`"
    assert pins["torch"] == needed["torch"], "the CPU image pins the torch the tests run with"


def test_gpu_lock_pins_veriroll_with_vllm_and_the_tested_torch():
    pins = lock.read_pins(lock.GPU_LOCK)
    assert _satisfied(pins, lock.project_requirements()) == []
    assert _satisfied(pins, lock.project_requirements("vllm")) == []
    assert pins["torch"] == lock.read_pins(lock.CPU_LOCK)["torch"].split("+")[0]
    assert not any(line.startswith("--") for line in lock.GPU_LOCK.read_text().splitlines()), "PyPI's CUDA torch"
