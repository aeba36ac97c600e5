"""PEFT adapter -> GGUF LoRA (``general.type=adapter``) that llama.cpp applies with PEFT's strength.

llama.cpp scales every module by ``adapter.lora.alpha / r`` with r read from the tensor shape. The file
alpha is chosen so that this is PEFT's scale (rsLoRA: ``alpha·sqrt(r)``); where modules differ
(rank/alpha patterns) each module's true scale is folded into its ``lora_b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..adapter import Adapter, LoraModule, saved_base_layers
from ..arch import ArchSpec
from ..checkpoint import Checkpoint
from ..errors import UserError
from ..experts import expert_tensor, stack_expert_loras
from ..merge import WeightedAdapter, plan_merge
from ..split_linears import split_lora_modules
from . import linear_attention
from .model import gguf_graph, permute_qk, qk_heads
from .tensor_names import tensor_name_map

MERGE_HINT = "use --adapters merge"


@dataclass
class GGUFLora:
    alpha: float
    graph_name: str  # llama.cpp's architecture (general.architecture), the base GGUF's
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # GGUF name -> tensor (torch shape)
    folded: list[str] = field(default_factory=list)  # modules whose scale was folded into lora_b


def lora_refusals(adapter: Adapter, base: Checkpoint | None, arch: ArchSpec) -> list[str]:
    """Why ``adapter`` has no GGUF LoRA form. Without ``base`` the checks that need it (saved base layers,
    tied embeddings) are skipped: that is what ``inspect`` can say about an adapter on its own."""
    problems = []
    if adapter.use_dora:
        problems.append(f"DoRA has no GGUF LoRA form in llama.cpp: {MERGE_HINT}")
    mts = [n for n, o in adapter.replacement_origin.items() if o in ("modules_to_save", "plain", "bias")]
    if mts or adapter.modules_to_save:
        problems.append(f"modules_to_save ({', '.join(adapter.modules_to_save or mts)}) has no GGUF LoRA form: "
                        f"{MERGE_HINT}")
    if adapter.config.get("lora_bias") or adapter.config.get("bias", "none") != "none":
        problems.append(f"trained biases have no GGUF LoRA form: {MERGE_HINT}")
    if base is None:
        return problems
    for name in sorted(saved_base_layers(adapter, base)[1]):
        problems.append(f"the adapter carries its own {name} (resized or retrained): {MERGE_HINT}")
    if base.tied_embeddings:
        touched = {m.module for m in adapter.modules.values()}
        if arch.lm_head in touched:
            problems.append(f"LoRA on lm_head over tied embeddings cannot be applied by llama.cpp: {MERGE_HINT}")
        if arch.embed in touched:
            problems.append(f"embedding LoRA on a base with tied embeddings crashes llama.cpp: {MERGE_HINT}")
    return problems


def build_gguf_lora(adapter: Adapter, base: Checkpoint, arch: ArchSpec) -> GGUFLora:
    from .config_keys import gguf_config_facts

    plan_merge(base, [WeightedAdapter(adapter)])  # fits this base (names, shapes)
    problems = lora_refusals(adapter, base, arch)
    if problems:
        raise UserError(f"adapter {adapter.name}: " + "; ".join(problems), "")
    cfg = base.config
    graph_name, garch, _ = gguf_graph(arch, cfg)  # refuses an architecture without a GGUF table entry
    tmap = tensor_name_map(graph_name, int(cfg["num_hidden_layers"]))
    ranks = {m.rank for m in adapter.modules.values()}
    acfg = adapter.config
    uniform = not (acfg.get("rank_pattern") or acfg.get("alpha_pattern")) and len(ranks) == 1
    alpha = float(acfg["lora_alpha"])
    if uniform and acfg.get("use_rslora"):
        alpha = alpha * math.sqrt(next(iter(ranks)))
    lora = GGUFLora(alpha, graph_name)
    q_factor = gguf_config_facts(arch.model_type, cfg).q_proj_factor
    experts: dict[str, dict[int, LoraModule]] = {}  # stacked GGUF tensor -> expert -> its LoRA
    expert_key = expert_tensor(arch)
    for mod in split_lora_modules(arch, cfg, adapter.modules.values()):
        if expert_key and (m := expert_key.match(mod.target)):
            gname = tmap.get_name(f"{m[1]}.experts.{m[3]}.weight", try_suffixes=(".weight",))  # the stacked name
            if gname is None:
                raise UserError(f"adapter {adapter.name}: {mod.module} has no GGUF tensor name", MERGE_HINT)
            experts.setdefault(gname, {})[int(m[2])] = mod
            continue
        gname = tmap.get_name(mod.target, try_suffixes=(".weight",))
        if gname is None:
            raise UserError(f"adapter {adapter.name}: {mod.module} has no GGUF tensor name", MERGE_HINT)
        if (why := next((w for suffix, w in garch.no_lora if gname.endswith(suffix)), None)) is not None:
            raise UserError(f"adapter {adapter.name}: llama.cpp applies no LoRA to {mod.module} ({gname}): {why}",
                            MERGE_HINT)
        factor = mod.scale * mod.rank / alpha  # llama.cpp applies alpha / rank
        if q_factor and mod.module.endswith("q_proj"):
            factor *= q_factor  # the base's q_proj rows carry the same fold (GGUFConfigFacts)
        A, B = mod.A.float(), mod.B.float()
        if not math.isclose(factor, 1.0, rel_tol=1e-12):
            B = B * factor
            lora.folded.append(mod.module)
        if mod.kind == "embedding":
            a, b = A.T.contiguous(), B.contiguous()  # lora_a [vocab, r], lora_b [n_embd, r]
        else:
            a, b = A, B
            if (heads := qk_heads(arch, cfg, mod.module)) is not None:
                b = permute_qk(b, heads)
            elif garch.delta_net:  # the base's value-head reorder, on B's rows or A's columns
                on_a, on_b = linear_attention.lora_transforms(mod.module, cfg)
                a, b = on_a(a) if on_a else a, on_b(b) if on_b else b
        lora.tensors[f"{gname}.lora_a"] = a
        lora.tensors[f"{gname}.lora_b"] = b
    for gname, mods in experts.items():
        _stack_experts(lora, gname, mods, arch.experts.expert_count(cfg))
    return lora


def _stack_experts(lora: GGUFLora, gname: str, mods: dict[int, LoraModule], n_experts: int) -> None:
    """One layer's expert LoRAs of one projection as llama.cpp applies them to its stacked tensor (through
    ``mul_mat_id``): ``lora_a [E, R, in]``, ``lora_b [E, out, R]``, every expert's scale folded into its B
    for the shared ``alpha / R``; ranks below R padded with zeros, experts without a LoRA all zeros."""
    rank = max(m.rank for m in mods.values())
    first = next(iter(mods.values()))
    factor = lambda mod: mod.scale * rank / lora.alpha  # noqa: E731 - llama.cpp applies alpha / rank
    a, b = stack_expert_loras(mods, n_experts, rank, (first.B.shape[0], first.A.shape[1]), factor)
    lora.tensors[f"{gname}.lora_a"] = a
    lora.tensors[f"{gname}.lora_b"] = b
    if any(not math.isclose(factor(m), 1.0, rel_tol=1e-12) for m in mods.values()):
        lora.folded.append(gname)


def write_gguf_lora(out: Path, lora: GGUFLora, name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(out), lora.graph_name)
    writer.add_type("adapter")
    writer.add_name(name)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", lora.alpha)
    writer.add_quantization_version(2)
    for gname, t in lora.tensors.items():
        writer.add_tensor(gname, t.to(torch.float32).contiguous().numpy().astype(np.float32, copy=False))
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
