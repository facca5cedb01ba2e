"""The committed locks: the dev lock satisfies pyproject.toml and is what this environment runs; the images'
locks come from it. Everything here reads committed files (and the installed environment setup.sh made from
them), never the registry: what PyPI serves today cannot fail these tests."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from veriroll.deploy import lock

DEV_ONLY = {"pytest", "pytest-timeout", "hypothesis", "ruff", "grpcio-tools", "matplotlib", "vllm", "uv"}
# The environment the dev lock is resolved for (lock.DEV_PYTHON on Linux x86-64).
DEV_ENV = {"python_version": lock.DEV_PYTHON, "python_full_version": f"{lock.DEV_PYTHON}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def _holds(req: Requirement, extras=("",)) -> bool:
    return req.marker is None or any(req.marker.evaluate({**DEV_ENV, "extra": extra}) for extra in extras)


def _unsatisfied(pins: dict[str, str], requirements: list[Requirement]) -> list[str]:
    missing = []
    for req in requirements:
        if not _holds(req):
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(Version(version), prereleases=True):
            missing.append(f"{req} (pinned: {version})")
    return missing


def test_the_dev_lock_satisfies_pyproject_and_hashes_every_pin():
    pins = lock.read_pins(lock.DEV_LOCK)
    assert _unsatisfied(pins, lock.project_requirements()) == [], "run scripts/relock.sh"
    for extra in ("dev", *lock.IMAGE_EXTRAS):
        assert _unsatisfied(pins, lock.project_requirements(extra)) == [], f"[{extra}]: run scripts/relock.sh"
    assert pins["torch"] == f"{lock.torch_pin()}+cpu", "development and CI run the CPU build of the pinned torch"
    hashes = lock.read_hashes(lock.DEV_LOCK)
    assert set(hashes) == set(pins) and all(hashes.values()), "every pin carries its files' hashes"
    model = lock.read_hashes(lock.MODEL_LOCK)
    assert list(model) == [canonicalize_name(lock.TEST_MODEL.split("==")[0])] and all(model.values())


def test_the_dev_lock_is_closed_under_its_packages_requirements():
    """Every requirement of every locked package (as installed from the lock) is met by another pin, so
    ``pip install --no-deps`` of the lock is a complete, consistent environment."""
    pins = lock.read_pins(lock.DEV_LOCK)
    wanted = {canonicalize_name(r.name): set(r.extras) for r in lock.project_requirements()}
    for req in lock.project_requirements("dev"):
        wanted.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    unmet = []
    for name, version in pins.items():
        dist = metadata.distribution(name)
        extras = ("", *wanted.get(name, ()))
        for line in dist.requires or []:
            req = Requirement(line)
            if _holds(req, extras) and _unsatisfied(pins, [req]):
                unmet.extend(f"{name} {version} needs {m}" for m in _unsatisfied(pins, [req]))
    assert unmet == [], "run scripts/relock.sh"


def test_this_environment_is_the_dev_lock():
    """scripts/setup.sh installed exactly the lock: a package at another version, or one the lock does not
    name, is something an earlier install or a hand left here (run scripts/setup.sh again)."""
    pins = {**lock.read_pins(lock.DEV_LOCK), **lock.read_pins(lock.MODEL_LOCK)}
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    assert {name: (installed.get(name), want) for name, want in pins.items() if installed.get(name) != want} == {}
    assert set(installed) - set(pins) - {"pip", "veriroll"} == set()


def test_the_cpu_image_installs_the_dev_locks_versions():
    pins = lock.read_pins(lock.CPU_LOCK)
    dev = lock.read_pins(lock.DEV_LOCK)
    assert {name: (v, dev.get(name)) for name, v in pins.items() if dev.get(name) != v} == {}
    assert _unsatisfied(pins, lock.project_requirements()) == []
    for extra in lock.IMAGE_EXTRAS:  # the scale-out roles' PostgreSQL driver, the nodes' swarm
        assert _unsatisfied(pins, lock.project_requirements(extra)) == [], extra
    assert pins["torch"].endswith("+cpu"), "the CPU image pins the CPU build of torch"
    assert f"--extra-index-url {lock.CPU_TORCH_INDEX}" in lock.CPU_LOCK.read_text().splitlines()
    assert DEV_ONLY.isdisjoint(pins), "dev tools and extras stay out of the CPU image"


def test_the_gpu_image_pins_vllm_with_the_dev_locks_torch_and_declares_every_other_difference():
    pins = lock.read_pins(lock.GPU_LOCK)
    gpu_env = {**DEV_ENV, "python_version": lock.GPU_PYTHON, "python_full_version": f"{lock.GPU_PYTHON}.0"}
    for req in lock.project_requirements() + lock.project_requirements("vllm"):
        if req.marker is None or req.marker.evaluate({**gpu_env, "extra": ""}):
            assert Version(pins[canonicalize_name(req.name)]) in req.specifier, str(req)
    dev = lock.read_pins(lock.DEV_LOCK)
    assert pins["torch"] == dev["torch"].split("+")[0], "PyPI's CUDA build of the torch the tests ran with"
    differs = {name: (v, dev[name]) for name, v in pins.items()
               if name in dev and name not in lock.BUILD_TOOLS and name != "torch" and v != dev[name]}
    declared = lock.declared_differences(lock.GPU_LOCK)
    assert {name: dev_version for name, (_, dev_version) in differs.items()} == declared
    assert len(declared) <= 5, f"the GPU image drifted from the dev lock: {declared}"
    assert not any(line.startswith("--") for line in lock.GPU_LOCK.read_text().splitlines()), "PyPI's CUDA torch"
