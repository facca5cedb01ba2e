"""Which veriroll and torch are installed, and the command to run when that torch does not fit the machine.

pip cannot see whether a machine has an NVIDIA driver, and PyPI's torch for Linux x86-64 is the CUDA build:
plain ``pip install veriroll`` on a CPU-only machine brings gigabytes of CUDA libraries it never uses. The
README's install lines avoid that; this names the fix for an install that did not use them.

It lives with the node (``veriroll node doctor`` checks the torch build); ``veriroll --version`` reads it too.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as metadata

from packaging.requirements import Requirement
from packaging.version import Version

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's index of CPU builds (versions ``X+cpu``); PyPI has none for Linux x86-64."""

CUDA_WHEEL_PREFIXES = ("nvidia-", "cuda-")
"""Names of the wheels that a CUDA build of torch brings (with ``triton``)."""


def package_version() -> str:
    """veriroll's version, read from the installed package's metadata (pyproject.toml is its one source)."""
    return metadata.version("veriroll")


def tested_torch_version() -> str | None:
    """The torch version veriroll pins (``torch==X`` in its requirements): the one its tests ran with. None for
    an editable install whose metadata predates the pin (scripts/setup.sh refreshes it)."""
    for line in metadata.requires("veriroll") or []:
        req = Requirement(line)
        pins = [spec.version for spec in req.specifier if spec.operator == "=="]
        if req.name == "torch" and req.marker is None and pins:
            return pins[0]
    return None


def is_cuda_wheel(name: str) -> bool:
    """Whether a distribution name is one of the CUDA wheels a CUDA build of torch depends on."""
    name = name.lower().replace("_", "-")
    return name.startswith(CUDA_WHEEL_PREFIXES) or name == "triton"


def installed_cuda_mb() -> float:
    """Megabytes on disk of the installed CUDA wheels (see :func:`is_cuda_wheel`)."""
    size = 0
    for dist in metadata.distributions():
        if is_cuda_wheel(dist.metadata["Name"] or ""):
            size += sum(f.size or 0 for f in dist.files or [])
    return size / 1e6


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA user-space driver loads here: without it a CUDA build of torch runs on CPU only."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cpu_install_line(tested: str) -> str:
    """The README's install line for a machine without an NVIDIA GPU: the CPU build, pinned with its label so
    pip fails rather than fall back to PyPI's CUDA build when PyTorch's index cannot be reached."""
    return f'pip install veriroll "torch=={tested}+cpu" --extra-index-url {CPU_INDEX}'


def torch_advice(torch: str | None, tested: str, cuda_mb: float, driver: bool) -> str | None:
    """What to run when torch (an installed version, or None) does not fit this machine or is not the tested
    version; None when it fits. ``cuda_mb``: installed CUDA wheels; ``driver``: an NVIDIA driver is present."""
    # A fresh environment, because pip keeps an installed torch that satisfies the pin, whatever its build.
    fix = "in a fresh virtual environment run: " + ("pip install 'veriroll[vllm]'" if driver else cpu_install_line(tested))
    if torch is None:
        return f"torch is not installed; {fix}"
    build = Version(torch)
    if build.public != tested:
        return f"veriroll is tested with torch {tested}, not {torch}; {fix}"
    if not driver and (cuda_mb > 0 or (build.local or "").startswith("cu")):
        return (f"torch {torch} is a CUDA build ({cuda_mb:.0f} MB of CUDA libraries) and this machine has no NVIDIA "
                f"driver, so it runs on CPU only; the CPU build is a tenth of the size: {fix}")
    if driver and build.local == "cpu":
        return f"this machine has an NVIDIA driver but torch {torch} is the CPU build; to use the GPU, {fix}"
    return None


def installed_torch_fit() -> tuple[str | None, str | None]:
    """(installed torch version or None, :func:`torch_advice` for this machine or None), from package metadata
    alone: nothing imports torch."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    tested = tested_torch_version()
    return torch, (torch_advice(torch, tested, installed_cuda_mb(), nvidia_driver_present()) if tested else None)


def version_text() -> str:
    """``veriroll --version``: veriroll's and torch's versions, then the advice of :func:`torch_advice`, if any."""
    torch, advice = installed_torch_fit()
    text = f"veriroll {package_version()} (torch {torch or 'not installed'})"
    return f"{text}\n{advice}" if advice else text
