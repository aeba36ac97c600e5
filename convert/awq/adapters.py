"""Adapters over an AWQ base. AWQ folds each group's scale into the operation before it, so inside the
4-bit model a linear's input may be divided by ``s_in`` (its weight columns were multiplied by it) and its
output divided by ``s_out`` (v_proj and up_proj rows, compensated by the next linear). The float model is
unchanged, but a LoRA trained on the 16-bit base would see ``x / s_in`` and add an unscaled output. The
exact fix is a rewrite of the adapter, same rank: ``A' = A · diag(s_in)``, ``B' = diag(1 / s_out) · B``.

``export --target awq`` writes the scales beside the model (``awq_scales.st``); the AWQ export's
adapters and every adapter ``tuneport serve`` loads over such a base are rewritten with them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..adapter import Adapter
from ..errors import UserError

# safetensors format, but not named *.safetensors: engines load every *.safetensors of an unindexed model
SCALES_FILE = "awq_scales.st"
INPUT, OUTPUT = "input_scale", "output_scale"
# Written into a rewritten adapter's directory: the scales it was rewritten for (never rewrite twice).
MARKER = "tuneport-awq-rescaled.json"


def write_scales(path: Path, scales: dict[str, dict[str, torch.Tensor]]) -> None:
    """``scales[module][INPUT|OUTPUT]`` (fp32 vectors) as one safetensors file."""
    tensors = {f"{m}.{kind}": v.float().contiguous() for m, kinds in scales.items() for kind, v in kinds.items()}
    save_file(tensors, str(path), metadata={"format": "tuneport-awq-scales",
                                            "rule": "A' = A * input_scale (columns); B' = B / output_scale (rows)"})


def read_scales(model_dir: Path) -> dict[str, dict[str, torch.Tensor]] | None:
    path = Path(model_dir) / SCALES_FILE
    if not path.exists():
        return None
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, kind = key.rsplit(".", 1)
            out.setdefault(module, {})[kind] = f.get_tensor(key)
    return out


def scales_digest(model_dir: Path) -> str | None:
    path = Path(model_dir) / SCALES_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else None


def rescale_adapter(adapter: Adapter, scales: dict[str, dict[str, torch.Tensor]]) -> Adapter:
    """The adapter as it must be applied inside the AWQ model (exact; same rank and names). A multimodal
    checkpoint's scales are under its own names, the adapter's modules under transformers 5's: both match."""
    from ..multimodal import checkpoint_aliases

    modules = {}
    for target, mod in adapter.modules.items():
        s = next((scales[n] for n in (mod.module, *checkpoint_aliases(mod.module)) if n in scales), None)
        if not s:
            modules[target] = mod
            continue
        if mod.kind != "linear" or mod.fan_in_fan_out:
            raise UserError(f"adapter {adapter.name}: {mod.module} is not a plain linear LoRA",
                            "adapters over an AWQ base must be PEFT LoRA on linear layers")
        A, B, bias = mod.A.float(), mod.B.float(), mod.bias
        if INPUT in s:
            A = A * s[INPUT].float().view(1, -1)
        if OUTPUT in s:
            B = B / s[OUTPUT].float().view(-1, 1)
            bias = bias.float() / s[OUTPUT].float() if bias is not None else None
        if mod.magnitude is not None:
            raise UserError(f"adapter {adapter.name} is DoRA", "DoRA cannot be served over an AWQ base; merge it")
        modules[target] = dataclasses.replace(mod, A=A, B=B, bias=bias)  # fp32: no rounding after the rewrite
    return dataclasses.replace(adapter, modules=modules)


def rescaled_for(adapter_dir: Path) -> str | None:
    """The scales digest an adapter directory was already rewritten for, or None."""
    import json

    marker = Path(adapter_dir) / MARKER
    try:
        return json.loads(marker.read_text()).get("scales_sha256") if marker.exists() else None
    except ValueError:
        return None


def mark_rescaled(adapter_dir: Path, digest: str) -> None:
    import json

    (Path(adapter_dir) / MARKER).write_text(json.dumps({
        "scales_sha256": digest, "note": "rewritten by tuneport for an AWQ base: A' = A * input_scale, "
        "B' = B / output_scale (see awq_scales.st beside the model)"}, indent=2))
