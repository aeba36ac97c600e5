"""The machine: accelerator, GPUs and their memory, RAM; which engines are installed."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..registry import ENGINES as _REGISTRY

ENGINE_NAMES = tuple(_REGISTRY)  # the values of `tuneport serve --engine` (besides auto)
INSTALL_HINTS = {e.name: e.install_hint for e in _REGISTRY.values()}
GIB = 1 << 30
MIB = 1 << 20


# -- hardware -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    accelerator: str  # "cuda" | "rocm" | "metal" (Apple Silicon) | "none"
    n_gpus: int = 0
    gpu_memory_bytes: int = 0  # per GPU (the smallest one when they differ; Apple Silicon: unified memory)
    ram_bytes: int = 0

    @property
    def gpu(self) -> bool:
        return self.accelerator != "none" and self.n_gpus > 0


def _ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia_smi_gpus() -> list[int]:
    """Memory (bytes) of each GPU nvidia-smi lists; [] without nvidia-smi or on any failure."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return [int(float(x)) * MIB for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def apple_silicon() -> bool:
    """A Mac with an Apple Silicon chip (its GPU shares the machine's memory; MLX runs on it)."""
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def detect_hardware() -> Hardware:
    """Apple Silicon; GPUs through torch (CUDA or ROCm/HIP), else nvidia-smi; never fails on a CPU-only machine."""
    ram = _ram_bytes()
    if apple_silicon():
        return Hardware("metal", 1, ram, ram)
    try:
        import torch
    except ImportError:
        mems = _nvidia_smi_gpus()
        return Hardware("cuda", len(mems), min(mems), ram) if mems else Hardware("none", 0, 0, ram)
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            n = torch.cuda.device_count()
            mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
            return Hardware("rocm" if getattr(torch.version, "hip", None) else "cuda", n, int(mem), ram)
    except RuntimeError:  # a broken driver: serve as if there were no GPU
        pass
    return Hardware("none", 0, 0, ram)


def installed_engines() -> set[str]:
    """Engines whose Python package is importable (not imported)."""
    return {name for name, spec in _REGISTRY.items() if spec.installed()}


