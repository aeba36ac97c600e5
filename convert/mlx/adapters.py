"""PEFT LoRA adapters as mlx-lm adapters: ``adapters.safetensors`` + ``adapter_config.json``.

mlx-lm's layout: per adapted module ``<module>.lora_a [in, r]`` and ``<module>.lora_b [r, out]`` (PEFT's
A and B transposed), ``<module>.m`` for DoRA; its delta is ``scale · lora_b.T @ lora_a.T`` with ONE
``scale`` and ONE rank for every module, applied to the ``keys`` (module paths inside a layer, or
whole-model paths such as ``model.embed_tokens``) of the last ``num_layers`` layers.

What PEFT expresses and mlx-lm does not is rewritten exactly or refused:
- per-module ranks (``rank_pattern``): padded with zeros to the largest rank (adds exactly nothing);
- per-module scales (``alpha_pattern``, rsLoRA): mlx's ``scale`` is the adapter's own, each module's
  ratio to it is folded into ``lora_b``;
- a layer subset that is not "the last N layers", or modules present in some layers only: every key
  in the covered layers gets a LoRA, the ones PEFT does not adapt get zeros;
- DoRA: mlx-lm's DoRA is PEFT's (per-output-row norm of W + scale·B·A, bias added after): magnitudes
  carried as ``m``;
- embedding LoRA: ``lora_a = A.T [vocab, r]``, ``lora_b = B.T``, times the architecture's embedding
  correction (``archs.MlxArch.embed_factor``); refused over tied embeddings (mlx-lm would apply it to the output
  projection too, PEFT does not);
- refused: ``modules_to_save`` and other full tensors (an mlx-lm LoRA adapter holds LoRA matrices only),
  LoRA biases, ``fan_in_fan_out``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..adapter import Adapter, saved_base_layers
from ..arch import arch_for
from ..checkpoint import Checkpoint
from ..errors import UserError
from ..experts import expert_tensor, fit_to_base, stack_expert_loras
from ..split_linears import part_shape, split_lora_modules
from . import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .archs import mlx_arch_for

MERGE_HINT = "export with --adapters merge (the default), which folds it into the weights exactly"


@dataclass
class MlxAdapter:
    """One adapter in mlx-lm's terms; ``tensors`` are fp32 numpy arrays by mlx parameter name."""

    name: str
    fine_tune_type: str  # "lora" or "dora"
    num_layers: int
    rank: int
    scale: float
    keys: list[str]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def config(self) -> dict:
        return {"fine_tune_type": self.fine_tune_type, "num_layers": self.num_layers,
                "lora_parameters": {"rank": self.rank, "scale": self.scale, "dropout": 0.0, "keys": self.keys}}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _split(module: str, layer_prefix: str) -> tuple[int | None, str]:
    """(layer index, key inside the layer) or (None, whole-model path)."""
    m = re.match(rf"^{re.escape(layer_prefix)}\.(\d+)\.(.+)$", module)
    return (int(m[1]), m[2]) if m else (None, module)


def refusals(adapter: Adapter, base: Checkpoint) -> list[str]:
    """Why ``adapter`` cannot be an mlx-lm adapter over ``base`` (empty when it can)."""
    reasons = []
    _, differ = saved_base_layers(adapter, base)
    full = sorted(n for n, o in adapter.replacement_origin.items() if o != "base_layer" or n in differ)
    if full:
        reasons.append(f"it replaces whole tensors ({', '.join(full[:3])}{', ...' if len(full) > 3 else ''}: "
                       "modules_to_save, a trained bias or a resized vocabulary); an mlx-lm adapter holds "
                       "LoRA matrices only")
    if any(m.bias is not None for m in adapter.modules.values()):
        reasons.append("it has LoRA biases (lora_bias), which mlx-lm's LoRA layers lack")
    if any(m.fan_in_fan_out for m in adapter.modules.values()):
        reasons.append("fan_in_fan_out (Conv1D weights): no architecture mlx exports here has them")
    pattern = expert_tensor(arch_for(base.model_type))
    if pattern and any(m.magnitude is not None and pattern.match(m.target) for m in adapter.modules.values()):
        reasons.append("DoRA on the experts: mlx-lm's LoRASwitchLinear has no DoRA")
    if base.tied_embeddings and any(m.kind == "embedding" for m in adapter.modules.values()):
        reasons.append("embedding LoRA over tied embeddings: mlx-lm would apply it to the output projection "
                       "too, PEFT applies it to the input lookup only")
    return reasons


def mlx_adapter(adapter: Adapter, base: Checkpoint) -> MlxAdapter:
    """``adapter`` (already checked against ``base`` by ``plan_merge``) in mlx-lm's layout, or a UserError."""
    fit_to_base(adapter, base)  # mixture-of-experts LoRA as per-expert modules (idempotent)
    if reasons := refusals(adapter, base):
        raise UserError(f"adapter {adapter.name} cannot be an mlx-lm adapter: {'; '.join(reasons)}", MERGE_HINT)
    arch = arch_for(base.model_type)
    embed_factor = mlx_arch_for(base.model_type).embed_factor
    n_layers = int(base.config["num_hidden_layers"])
    cfg = adapter.config
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r
    if scale == 0:
        scale = 1.0
    rank = max(adapter.ranks)
    dora = adapter.use_dora

    march = mlx_arch_for(base.model_type)
    switch, stacked_block = dict(march.switch_mlp), march.switch_block
    expert = re.compile(r"^(.+)\.experts\.(\d+)\.(\w+)$") if switch else None
    placed: dict[tuple[int | None, str], object] = {}
    for mod in split_lora_modules(arch, base.config, adapter.modules.values()):
        i, key = _split(mod.module, arch.layer_prefix)
        if expert is not None and (m := expert.match(key)) and m[3] in switch:  # into the stacked switch_mlp
            placed.setdefault((i, f"{m[1]}.{stacked_block}.{switch[m[3]]}"), {})[int(m[2])] = mod
            continue
        placed[(i, key)] = mod
    layers = sorted({i for i, _ in placed if i is not None})
    first = layers[0] if layers else n_layers
    layer_keys = sorted({k for i, k in placed if i is not None})
    prefix = mlx_arch_for(base.model_type).weight_prefix  # mlx-lm's tree above the model's own names
    keys = layer_keys + sorted(prefix + k for i, k in placed if i is None)
    out = MlxAdapter(adapter.name, "dora" if dora else "lora", n_layers - first if layers else n_layers,
                     rank, scale, keys)

    def put(path: str, mod) -> None:
        ratio = mod.scale / scale
        if mod.kind == "embedding" and embed_factor is not None:
            ratio *= embed_factor(base.config)
        a = torch.zeros(mod.A.shape[1], rank)
        b = torch.zeros(rank, mod.B.shape[0])
        a[:, : mod.rank] = mod.A.float().T
        b[: mod.rank] = mod.B.float().T * ratio
        out.tensors[f"{prefix}{path}.lora_a"] = a.numpy()
        out.tensors[f"{prefix}{path}.lora_b"] = b.numpy()
        if mod.magnitude is not None:
            out.tensors[f"{prefix}{path}.m"] = mod.magnitude.float().numpy()

    n_experts = arch.experts.expert_count(base.config) if arch.experts else 0
    stacked_disk = {sw: proj for proj, sw in switch.items()}

    def put_experts(path: str, mods: dict, shape: tuple[int, int]) -> None:
        """mlx-lm's LoRASwitchLinear: ``lora_a [E, r, in]``, ``lora_b [E, out, r]`` (not transposed); experts
        without a LoRA get zeros."""
        a, b = stack_expert_loras(mods, n_experts, rank, shape, lambda mod: mod.scale / scale)
        out.tensors[f"{prefix}{path}.lora_a"] = a.numpy()
        out.tensors[f"{prefix}{path}.lora_b"] = b.numpy()

    def expert_shape(path: str) -> tuple[int, int] | None:
        block, _, name = path.rpartition(f".{stacked_block}.")
        return base.weight_shape(f"{block}.experts.0.{stacked_disk[name]}.weight") if name in stacked_disk else None

    filled = 0
    for i in range(first, n_layers):
        for key in layer_keys:
            path = f"{arch.layer_prefix}.{i}.{key}"
            mod = placed.get((i, key))
            if (shape := expert_shape(path)) is not None:
                put_experts(path, mod or {}, shape)
                filled += mod is None
                continue
            if mod is not None:
                put(path, mod)
                continue
            shape = base.weight_shape(f"{path}.weight") or part_shape(
                arch, base.config, base.weight_shape, f"{path}.weight")
            if shape is None:  # a layer without this module (a dense layer of a MoE model): mlx-lm skips it too
                continue
            out.tensors[f"{prefix}{path}.lora_a"] = np.zeros((shape[1], rank), np.float32)
            out.tensors[f"{prefix}{path}.lora_b"] = np.zeros((rank, shape[0]), np.float32)
            filled += 1
    for (i, key), mod in placed.items():
        if i is None:
            put(key, mod)
    if filled:
        out.notes.append(f"{adapter.name}: {filled} module(s) in layers {first}-{n_layers - 1} that PEFT leaves "
                         "alone get zero LoRA matrices (mlx-lm adapts every key in the last num_layers layers)")
    if len(adapter.ranks) > 1:
        out.notes.append(f"{adapter.name}: ranks {adapter.ranks} padded with zeros to {rank} (mlx-lm has one rank)")
    if len({round(m.scale, 12) for m in adapter.modules.values()}) > 1:
        out.notes.append(f"{adapter.name}: per-module scales folded into lora_b (mlx-lm has one scale, {scale:g})")
    return out


def write_mlx_adapter(adapter: MlxAdapter, out: Path) -> None:
    """``out/adapters.safetensors`` and ``out/adapter_config.json`` (``out`` is created)."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in adapter.tensors.items()}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "mlx"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter.config(), indent=2))
