"""A PEFT adapter rewritten so that exllamav3's run-time loader applies it exactly as PEFT does.

exllamav3's ``LoRA.from_directory`` (``exllamav3/model/lora.py``) reads ``r``, ``lora_alpha`` and ``use_rslora``
from adapter_config.json and scales every module by that one number; it ignores ``rank_pattern`` /
``alpha_pattern``, DoRA magnitudes, embedding LoRA (``lora_embedding_A/B``), ``modules_to_save`` and biases (only
keys holding ``.lora_A.`` / ``.lora_B.`` are read), refuses ``fan_in_fan_out``, and matches modules by key suffix
against its own linears, silently skipping the rest (a LoRA on Phi-3's fused ``qkv_proj`` finds nothing: exllamav3
splits it into q/k/v). So the adapter is rewritten here, from tuneport's reader (:mod:`tuneport.convert.adapter`):

- each module's PEFT scale (patterns, rsLoRA) is baked into ``lora_B`` and every module padded with zero rows
  to one rank R, under a config ``r = lora_alpha = R`` (scale 1, no patterns, no rsLoRA): any loader, whether it
  reads patterns or not, computes PEFT's numbers;
- a LoRA on a linear exllamav3 splits (``read.FUSED_PARTS``) becomes one LoRA per part: ``A`` shared, ``B``'s rows
  sliced as the fused weight's are;
- ``fan_in_fan_out`` only says the *base* weight is stored transposed (GPT-2's Conv1D); the LoRA's own matrices are
  PEFT's ``A [r, in]``, ``B [out, r]`` either way, so the flag is dropped;
- what exllamav3 cannot apply is refused (DoRA, embedding LoRA, ``modules_to_save``, biases, expert parameters,
  modules the EXL3 model does not have): merge those instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapter import PEFT_PREFIX, Adapter, load_adapter
from ..cache import cache_dir, write_once
from ..errors import UserError
from ..hashing import config_digest, content_digest
from .read import FUSED_PARTS, Exl3Model, part_rows

WEIGHTS = "adapter_model.safetensors"
MERGE_HINT = "merge it: tuneport export --target exl3 --adapter PATH"


@dataclass
class Exl3Lora:
    """An adapter as exllamav3 applies it: per target linear, ``A [R, in]`` and ``B [out, R]`` with the scale in B."""

    name: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # exllamav3 linear key -> (A, B), fp32
    notes: list[str]

    def config(self) -> dict:
        return {"peft_type": "LORA", "r": self.rank, "lora_alpha": self.rank, "use_rslora": False,
                "fan_in_fan_out": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
                "target_modules": sorted({k.rsplit(".", 1)[-1] for k in self.modules}), "use_dora": False,
                "modules_to_save": None, "task_type": "CAUSAL_LM"}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, (a, b) in sorted(self.modules.items()):
            out[f"{PEFT_PREFIX}{key}.lora_A.weight"] = a.clone()  # a split linear's parts share A: one copy each
            out[f"{PEFT_PREFIX}{key}.lora_B.weight"] = b.clone()
        return out

    @property
    def nbytes(self) -> int:
        """What exllamav3 holds: fp16 A and B (before its padding to the linears' 128-multiples)."""
        return sum(2 * (a.numel() + b.numel()) for a, b in self.modules.values())


def refusals(adapter: Adapter) -> list[str]:
    """What in ``adapter`` exllamav3's loader would drop or refuse (each a reason)."""
    problems = []
    if adapter.use_dora:
        problems.append("DoRA (use_dora): exllamav3 applies no magnitude vector")
    if emb := sorted(m.module for m in adapter.modules.values() if m.kind == "embedding"):
        problems.append(f"LoRA on embeddings ({', '.join(emb[:3])}): exllamav3 applies LoRA to linears only")
    if adapter.param_loras:
        problems.append("LoRA on expert parameters (target_parameters): exllamav3 applies LoRA to linears only")
    if biased := sorted(m.module for m in adapter.modules.values() if m.bias is not None):
        problems.append(f"lora_bias on {', '.join(biased[:3])}: exllamav3 adds no LoRA bias")
    for origin in sorted(set(adapter.replacement_origin.values())):
        names = sorted(n for n, o in adapter.replacement_origin.items() if o == origin)
        what = {"modules_to_save": "modules_to_save", "bias": "trained biases (bias=all / lora_only)"}.get(
            origin, "saved base layers")
        problems.append(f"{what} ({', '.join(names[:3])}): exllamav3 loads no whole tensors from an adapter")
    return problems


def exl3_lora(adapter: Adapter, model: Exl3Model) -> Exl3Lora:
    """``adapter`` (tuneport's reader) as exllamav3 applies it over ``model``; a UserError for what it cannot."""
    if problems := refusals(adapter):
        raise UserError(f"exllamav3 cannot apply adapter {adapter.name} at run time: " + "; ".join(problems),
                        MERGE_HINT)
    linears = {k: (lin.in_features, lin.out_features) for k, lin in model.linears.items()}
    for name in model.ckpt.names():  # linears exllamav3 left unquantized (a 16-bit head): .weight [out, in]
        key = name.removesuffix(".weight")
        shape = model.ckpt.meta(name).shape
        if name.endswith(".weight") and len(shape) == 2 and "embed" not in key and key not in linears:
            linears[key] = (shape[1], shape[0])
    rank = max(m.rank for m in adapter.modules.values())
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    notes, misfits = [], []
    for m in adapter.modules.values():
        a = torch.zeros(rank, m.A.shape[1])
        a[: m.rank] = m.A.float()
        b = torch.zeros(m.B.shape[0], rank)
        b[:, : m.rank] = m.B.float() * m.scale
        parent, _, leaf = m.module.rpartition(".")
        if m.module not in linears and leaf in FUSED_PARTS:
            sizes = part_rows(model.ckpt.config, leaf)
            if sum(r for _, r in sizes) != b.shape[0]:
                misfits.append(f"{m.module} has {b.shape[0]} output rows, the model's parts {sizes}")
                continue
            notes.append(f"{m.module}: split into {', '.join(p for p, _ in sizes)} (exllamav3 stores them split)")
            for (part, _), rows in zip(sizes, b.split([r for _, r in sizes]), strict=True):
                modules[f"{parent}.{part}"] = (a, rows)
        else:
            modules[m.module] = (a, b)
    for key, (a, b) in modules.items():
        dims = linears.get(key)
        if dims is None:
            misfits.append(f"{key} is not a linear of this model")
        elif a.shape[1] > dims[0] or b.shape[0] > dims[1]:
            misfits.append(f"{key} is [{b.shape[0]}, {a.shape[1]}], the model's [{dims[1]}, {dims[0]}] (padded)")
    if misfits:
        more = f" (and {len(misfits) - 3} more)" if len(misfits) > 3 else ""
        raise UserError(f"adapter {adapter.name} does not fit {model.path.name}: {'; '.join(misfits[:3])}{more}",
                        "it was trained for another model: serve it with its own base")
    if len(adapter.ranks) > 1:
        notes.append(f"ranks {adapter.ranks} padded with zeros to {rank} (exllamav3 reads one rank)")
    return Exl3Lora(adapter.name, rank, modules, notes)


def write_exl3_lora(lora: Exl3Lora, out: Path) -> None:
    """``lora`` as a PEFT directory (adapter_config.json + adapter_model.safetensors, fp32) in ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(lora.tensors(), str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(lora.config(), indent=2) + "\n")


def cached_exl3_adapter(adapter_dir: Path, model: Exl3Model, name: str | None = None) -> tuple[Path, Exl3Lora]:
    """The PEFT adapter in ``adapter_dir`` rewritten for ``model`` (see the module), written once into the cache
    (keyed by the adapter's files and the model's config), and the rewritten adapter itself."""
    adapter = load_adapter(adapter_dir, name)
    lora = exl3_lora(adapter, model)
    out = cache_dir() / "exl3-adapters" / f"{content_digest(adapter.path)}-{config_digest(model.path)}"
    return write_once(out, lambda tmp: write_exl3_lora(lora, tmp)), lora
