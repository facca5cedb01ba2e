"""What each README install line brings in, what the wheel ships, and what ``veriroll --version`` says.

The install lines are resolved by pip itself in a dry run (``pip install --dry-run --report``) against the
package registry, with this machine's pip configuration set aside (its local wheels, extra indexes and
constraints): the tests see what a user's pip sees. They skip, saying why, where the registry is unreachable.
``cpu_install_mb()`` is the figure benchmarks/first_run.py reports as ``install_mb_cpu``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

from veriroll.node.install import CPU_INDEX, cpu_install_line, is_cuda_wheel, torch_advice

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README = (ROOT / "README.md").read_text()
TORCH_PIN = next(r.split("==")[1] for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch=="))
"""The tested torch version: pyproject.toml's exact pin."""

# Settings of this machine's pip that a user's pip does not have: local wheels (a CPU torch among them),
# extra indexes and a constraints file. PIP_CONFIG_FILE=devnull makes pip skip every configuration file.
LOCAL_PIP_SETTINGS = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")
PIP_NETWORK = ["--timeout", "60", "--retries", "2"]


def readme_install_lines() -> dict[str, list[str]]:
    """The ``pip install`` lines of the README's Install section, as argv lists, keyed ``cpu``, ``vllm``, ``nvidia``."""
    section = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    lines = [shlex.split(line) for line in section.splitlines() if line.startswith("pip install ")]
    keyed = {}
    for argv in lines:
        if any("+cpu" in arg for arg in argv):
            keyed["cpu"] = argv
        elif "veriroll[vllm]" in argv:
            keyed["vllm"] = argv
        elif argv == ["pip", "install", "veriroll"]:
            keyed["nvidia"] = argv
    return keyed


def pip_env() -> dict[str, str]:
    """The environment for a pip that sees only the package registry (see LOCAL_PIP_SETTINGS)."""
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PIP_SETTINGS}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def build_wheel(out_dir: Path) -> Path:
    """Build veriroll's wheel from a copy of the packaged folders (the build writes into its source tree)."""
    src = out_dir / "src"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(out_dir), str(src)], check=True, capture_output=True, text=True)
    return next(out_dir.glob("veriroll-*.whl"))


def registry_problem() -> str | None:
    """Why the package registry cannot be asked (pip's own words), or None when it answers."""
    probe = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                            "--quiet", "--timeout", "15", "--retries", "0", "packaging"],
                           env=pip_env(), capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["pip failed"])[-1]


def local_cpu_torch_dir() -> Path | None:
    """A folder among this machine's pip find-links that holds the CPU torch wheel of TORCH_PIN, if any."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            places += value.strip("'\"").split()
    for place in places:
        folder = Path(place.removeprefix("file://"))
        if folder.is_dir() and any(folder.glob(f"torch-{TORCH_PIN}+cpu-*.whl")):
            return folder
    return None


def cpu_torch_source() -> tuple[list[str], str]:
    """pip arguments that offer PyTorch's CPU builds, and where they come from: PyTorch's CPU index, or where
    that is unreachable, a local copy of its torch wheel that this machine's pip is configured with."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{CPU_INDEX}/torch/", method="HEAD"), timeout=15):
            return ["--extra-index-url", CPU_INDEX], CPU_INDEX
    except OSError as exc:
        unreachable = f"PyTorch's CPU index is unreachable from here ({exc})"
    folder = local_cpu_torch_dir()
    if folder is None:
        raise LookupError(f"{unreachable}, and pip has no local copy of torch {TORCH_PIN}+cpu")
    return ["--find-links", str(folder)], f"{folder} ({unreachable})"


def resolve(argv: list[str], wheel: Path, report: Path) -> dict[str, dict]:
    """What ``argv`` (a README ``pip install`` line) would install into an empty environment, by name: pip's
    installation report entries. ``veriroll`` in the line is the wheel built from this tree."""
    args = [re.sub(r"^veriroll(?=\[|$)", str(wheel), arg) for arg in argv[2:]]
    if CPU_INDEX in args:  # where the CPU index is unreachable, a local copy of its torch wheel stands in
        at = args.index(CPU_INDEX)
        args[at - 1:at + 1] = cpu_torch_source()[0]
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          *PIP_NETWORK, "--report", str(report), *args], env=pip_env(), capture_output=True, text=True)
    assert run.returncode == 0, f"pip could not resolve {shlex.join(argv)}:\n{run.stderr[-3000:]}"
    return {entry["metadata"]["name"].lower(): entry for entry in json.loads(report.read_text())["install"]}


def download_bytes(url: str) -> int:
    """Size of one wheel pip would fetch: a HEAD request, or the file itself for a local one."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return os.path.getsize(urllib.request.url2pathname(parsed.path))
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
        return int(response.headers["Content-Length"])


def download_mb(resolved: dict[str, dict]) -> float:
    """Megabytes (10^6 bytes) of wheels that a resolved install downloads."""
    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(download_bytes, [e["download_info"]["url"] for e in resolved.values()])) / 1e6


def cpu_install_mb() -> float:
    """Megabytes downloaded by the README's CPU install line into an empty environment (for ``install_mb_cpu``).
    Raises ``LookupError`` naming the cause where the registry or PyTorch's CPU index cannot be reached."""
    problem = registry_problem()
    if problem:
        raise LookupError(f"the package registry is unreachable: {problem}")
    with tempfile.TemporaryDirectory() as tmp:
        resolved = resolve(readme_install_lines()["cpu"], build_wheel(Path(tmp)), Path(tmp) / "report.json")
        return round(download_mb(resolved), 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def registry():
    if (sys.platform, platform.machine()) != ("linux", "x86_64"):
        pytest.skip("the install lines are for Linux x86-64, where PyPI's torch is the CUDA build")
    problem = registry_problem()
    if problem:
        pytest.skip(f"the package registry is unreachable, so no install line can be resolved: {problem}")


def test_readme_has_a_line_per_machine_and_each_pins_the_tested_torch():
    lines = readme_install_lines()
    assert set(lines) == {"cpu", "vllm", "nvidia"}, f"README Install section lines found: {lines}"
    assert cpu_install_line(TORCH_PIN) in README  # what `veriroll --version` advises is what the README shows
    assert f"torch=={TORCH_PIN}+cpu" in lines["cpu"] and CPU_INDEX in lines["cpu"]
    assert [r for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")] == [f"torch=={TORCH_PIN}"]


def test_setup_script_installs_the_lock_and_the_lock_holds_the_cpu_build_of_the_pinned_torch():
    from veriroll.deploy import lock

    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert TORCH_PIN not in setup, "scripts/setup.sh installs the lock; the torch pin lives in pyproject.toml alone"
    install = re.search(r"^\s*install=\((.*)\)$", setup, re.MULTILINE).group(1)
    # Exactly the lock's files, nothing resolved: a fresh clone gets what the tests ran with.
    assert "--require-hashes" in install and "--no-deps" in install
    assert '-r "${locks[0]}" -r "${locks[1]}"' in install
    assert 'locks=(requirements/dev-cpu.txt requirements/test-model.txt)' in setup
    assert lock.read_pins(lock.DEV_LOCK)["torch"] == f"{TORCH_PIN}+cpu"


def test_wheel_ships_every_deploy_file_and_the_dashboard(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p for folder in ("deploy", "coordinator/static") for p in (ROOT / folder).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    missing = [str(p.relative_to(ROOT)) for p in shipped if f"veriroll/{p.relative_to(ROOT).as_posix()}" not in names]
    assert not missing, f"add these to [tool.setuptools.package-data] in pyproject.toml: {missing}"
    assert {"veriroll/deploy/examples/coordinator.toml", "veriroll/deploy/examples/node.toml",
            "veriroll/deploy/grafana/provisioning/datasources/prometheus.yml"} <= names


def test_version_prints_veriroll_and_torch_from_the_installed_metadata():
    veriroll = Path(sys.executable).with_name("veriroll")
    run = subprocess.run([str(veriroll), "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first = run.stdout.splitlines()[0]
    assert first == f"veriroll {metadata.version('veriroll')} (torch {metadata.version('torch')})"


def test_advice_for_a_cuda_build_without_a_driver_is_the_cpu_line():
    advice = torch_advice("2.13.0", "2.13.0", cuda_mb=4100.0, driver=False)
    assert "CUDA build (4100 MB" in advice and cpu_install_line("2.13.0") in advice
    assert cpu_install_line("2.13.0") in torch_advice("2.13.0+cu130", "2.13.0", cuda_mb=0.0, driver=False)


def test_advice_is_silent_when_the_build_fits_the_machine():
    assert torch_advice("2.13.0+cpu", "2.13.0", cuda_mb=0.0, driver=False) is None
    assert torch_advice("2.13.0", "2.13.0", cuda_mb=4100.0, driver=True) is None


def test_advice_names_the_tested_version_the_gpu_line_and_a_missing_torch():
    assert "tested with torch 2.13.0, not 2.14.1" in torch_advice("2.14.1", "2.13.0", cuda_mb=4100.0, driver=True)
    assert "pip install 'veriroll[vllm]'" in torch_advice("2.13.0+cpu", "2.13.0", cuda_mb=0.0, driver=True)
    assert cpu_install_line("2.13.0") in torch_advice(None, "2.13.0", cuda_mb=0.0, driver=False)


def test_cpu_line_brings_the_cpu_build_of_the_tested_torch_and_no_cuda_wheel(wheel, registry, tmp_path):
    try:
        source = cpu_torch_source()[1]
    except LookupError as exc:
        pytest.skip(str(exc))
    resolved = resolve(readme_install_lines()["cpu"], wheel, tmp_path / "report.json")
    assert resolved["torch"]["metadata"]["version"] == f"{TORCH_PIN}+cpu", f"torch from {source}"
    cuda = sorted(name for name in resolved if is_cuda_wheel(name))
    assert not cuda, f"the CPU line brings CUDA wheels: {cuda}"
    assert "veriroll" in resolved and "transformers" in resolved


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vllm", "nvidia"])
def test_gpu_lines_bring_the_tested_torch(case, wheel, registry, tmp_path):
    resolved = resolve(readme_install_lines()[case], wheel, tmp_path / "report.json")
    assert resolved["torch"]["metadata"]["version"] == TORCH_PIN
    assert any(is_cuda_wheel(name) for name in resolved), "PyPI's torch for Linux x86-64 is the CUDA build"
    if case == "vllm":
        assert "vllm" in resolved
