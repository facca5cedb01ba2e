"""What this machine has, for the Register report and for choosing an engine and batch size."""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass, field

import psutil


@dataclass
class GpuInfo:
    name: str
    memory_bytes: int


@dataclass
class Hardware:
    cpu: str
    cpu_count: int
    ram_bytes: int
    disk_free_bytes: int
    os: str
    gpus: list[GpuInfo] = field(default_factory=list)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)


def detect_hardware(path: str = ".") -> Hardware:
    gpus: list[GpuInfo] = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                gpus.append(GpuInfo(p.name, int(p.total_memory)))
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU", not a crash
        gpus = []
    try:
        disk = shutil.disk_usage(os.path.expanduser(path) if os.path.exists(os.path.expanduser(path)) else ".").free
    except OSError:
        disk = 0
    return Hardware(
        cpu=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count() or 1,
        ram_bytes=int(psutil.virtual_memory().total),
        disk_free_bytes=int(disk),
        os=f"{platform.system()} {platform.release()}",
        gpus=gpus,
    )


def vllm_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def choose_engine(requested: str, hw: Hardware) -> str:
    """'auto' → vllm when there is a GPU and vllm is installed, else torch."""
    if requested != "auto":
        return requested
    return "vllm" if hw.has_gpu and vllm_available() else "torch"


def choose_device(requested: str, hw: Hardware) -> str:
    if requested != "auto":
        return requested
    return "cuda" if hw.has_gpu else "cpu"
