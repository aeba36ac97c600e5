"""What this machine's CPU can run, where an engine's kernels depend on it."""

from __future__ import annotations

import functools
from pathlib import Path

from .errors import UserError

# vLLM's CPU W4A16 kernel needs these (upstream issue 55613: AVX2-only CPUs crash at the first forward)
W4A16_CPU_FLAGS = ("avx512f",)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def w4a16_cpu_problem() -> str | None:
    """Why vLLM's CPU W4A16 kernel cannot run here, or None."""
    flags = cpu_flags()
    if not flags:
        return None  # not Linux: vLLM's CPU build is Linux-only anyway
    missing = [f for f in W4A16_CPU_FLAGS if f not in flags]
    if missing:
        return (f"this CPU lacks {', '.join(missing)}: vLLM's CPU W4A16 kernel loads a 4-bit model and then "
                "crashes at the first forward pass (vLLM issue 55613)")
    return None


def require_w4a16_cpu() -> None:
    if (why := w4a16_cpu_problem()) and not _has_cuda():
        raise UserError(why, "serve the 4-bit model on a GPU or an AVX-512 CPU, or export --target vllm / gguf")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
