"""Mixture-of-experts adapters in the checkpoint's on-disk layout: one LoRA per expert projection.

transformers 5 fuses a layer's experts into 3-D parameters in memory, so PEFT trains LoRA on them through
``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, the router ``mlp.gate.weight``).
Checkpoints keep one tensor per expert on disk (Mixtral ``block_sparse_moe.experts.{e}.w1``, Qwen3-MoE
``mlp.experts.{e}.gate_proj``), and so do adapters trained with transformers 4. Everything downstream (merge,
GGUF LoRA) works on the disk names, so a fused LoRA is split here, exactly: expert ``e`` of PEFT's
``ParamWrapper`` is ``scale · B[:, :, e] @ A[e]``, and its gate/up halves are the two halves of B's rows.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from .adapter import Adapter, LoraModule, ParamLora, module_scale
from .arch import ArchSpec, ExpertLayout
from .errors import UserError
from .fused_experts import fused_views

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

FUSED = ("gate_up_proj", "down_proj")  # transformers 5's fused expert parameters


def fit_to_base(adapter: Adapter, base: Checkpoint) -> Adapter:
    """``adapter`` with its modules named as ``base`` stores them: memory-only names (Mixtral's router
    ``mlp.gate``) renamed, LoRAs on fused expert parameters split per expert. Idempotent, in place."""
    arch = base.arch
    layout = arch.experts if arch is not None else None
    if layout is None:
        if adapter.param_loras:
            targets = ", ".join(adapter.config.get("target_parameters") or [])
            if arch is not None and (why := arch.refusals.get("expert_lora")):
                raise UserError(f"adapter {adapter.name} has LoRA on raw parameters ({targets}): {why}",
                                "train the adapter on the other modules, or merge it with PEFT (merge_and_unload)")
            raise UserError(f"adapter {adapter.name} has LoRA on raw parameters ({targets}), which "
                            f"{base.model_type or 'this base'} has no experts for",
                            "the adapter was trained on another model: pass the base it was trained on")
        return adapter
    _rename_router(adapter, layout)
    n_experts = layout.expert_count(base.config)
    for p in adapter.param_loras:
        for mod in _split(adapter, p, arch, layout, n_experts, base):
            adapter.modules[mod.target] = mod
    adapter.param_loras = []
    return adapter


def _rename_router(adapter: Adapter, layout: ExpertLayout) -> None:
    if layout.memory_block == layout.disk_block:
        return
    memory = re.compile(rf"^(.*\.\d+)\.{layout.memory_block}\.{layout.router}(\.\w+)?$")
    for target, mod in list(adapter.modules.items()):
        if m := memory.match(mod.module):
            del adapter.modules[target]
            mod.module = f"{m[1]}.{layout.disk_block}.{layout.router}"
            adapter.modules[mod.target] = mod
    # modules_to_save on the router (a fully trained router): its tensors by their disk names too
    adapter.replacements = {
        (f"{m[1]}.{layout.disk_block}.{layout.router}{m[2]}" if (m := memory.match(name)) and m[2] else name): t
        for name, t in adapter.replacements.items()}


TRANSPOSED_BEFORE = (0, 19, 1)  # PEFT < 0.19.1 kept the expert parameter's [in, out] order in A and B


def _layouts(adapter: Adapter) -> tuple[bool, ...]:
    """Whether the fused-expert LoRA may be PEFT's old, transposed layout (False: the current one)."""
    version = str(adapter.config.get("peft_version") or "")
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        return (False, True)  # unknown: told apart by the shapes
    return (tuple(map(int, m.groups())) < TRANSPOSED_BEFORE,)


def _split(adapter: Adapter, p: ParamLora, arch: ArchSpec, layout: ExpertLayout, n_experts: int,
           base: Checkpoint) -> list[LoraModule]:
    A, B = p.A, p.B
    if A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0]:
        raise UserError(f"adapter {adapter.path}: {p.container} has lora_A {list(A.shape)} and lora_B "
                        f"{list(B.shape)}, not a LoRA pair", "the adapter file is corrupt: re-save it")
    m = re.match(rf"^(.*\.\d+)\.{layout.memory_block}\.(experts|{layout.router})$", p.container)
    if m is None:
        raise UserError(f"adapter {adapter.name}: LoRA on a raw parameter of {p.container}, which tuneport does not "
                        f"know for {arch.model_type} (it knows {layout.memory_block}.experts.gate_up_proj, "
                        f"down_proj and {layout.memory_block}.{layout.router}.weight)", "merge it with PEFT first")
    layer, kind = m[1], m[2]
    disk = f"{layer}.{layout.disk_block}"
    if kind != "experts":  # the router: a 2-D parameter, a plain LoRA
        alpha, scale = module_scale(adapter, f"{p.container}.weight", A.shape[0])
        return [LoraModule(f"{disk}.{layout.router}", "linear", A, B, A.shape[0], alpha, scale)]
    gate = base.weight_shape(f"{disk}.experts.0.{layout.gate}.weight")
    if gate is None:  # a multimodal checkpoint, the adapter trained on the text model AutoModelForCausalLM loads
        from .multimodal import checkpoint_aliases

        alias = next((a for a in checkpoint_aliases(f"{disk}.experts.0.{layout.gate}.weight") if a in base), None)
        if alias is not None:
            disk, gate = alias.split(".experts.0.")[0], base.weight_shape(alias)
    if gate is None:
        raise UserError(f"adapter {adapter.name} targets the experts of {layer}, which the base lacks",
                        "the adapter was trained on another model: pass the base it was trained on")
    inter, hidden = gate
    shapes = {"gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}  # (in, out) per expert
    wanted = [t.rsplit(".", 1)[-1] for t in adapter.config.get("target_parameters") or []]
    # experts kept [E, in, out] in memory (gpt-oss, Llama 4): PEFT's layout follows transformers' is_transposed mark,
    # not its version (ExpertLayout.peft_transposed)
    layouts = (False, True) if layout.stored_in_out else _layouts(adapter)
    fits = [(f, transposed) for f in FUSED if f in wanted for transposed in layouts
            if (shapes[f][::-1] if transposed else shapes[f]) == (A.shape[1], B.shape[0])]
    if layout.stored_in_out and len(fits) == 2 and len({f for f, _ in fits}) == 1:  # a square projection
        fits = [(f, t) for f, t in fits if t == layout.peft_transposed]
    if len(fits) != 1 or A.shape[0] % n_experts:
        if len({f for f, _ in fits}) == 1 and len(fits) == 2:
            raise UserError(f"adapter {adapter.name}: PEFT's layout of the LoRA on {p.container} cannot be told from "
                            "its square shapes, and adapter_config.json names no peft_version (PEFT before 0.19.1 "
                            "stored expert LoRA transposed)",
                            "add the peft_version that saved it to adapter_config.json")
        raise UserError(f"adapter {adapter.name}: the LoRA on {p.container} (lora_A {list(A.shape)}, lora_B "
                        f"{list(B.shape)}) fits none of the base's {n_experts} experts",
                        "the adapter was trained on another model: pass the base it was trained on")
    fused, transposed = fits[0]
    rank = A.shape[0] // n_experts
    alpha, scale = module_scale(adapter, f"{p.container}.{fused}", rank)
    a3 = A.reshape(n_experts, rank, A.shape[1])
    b3 = B.reshape(B.shape[0], rank, n_experts)
    out = []
    for e in range(n_experts):
        a, b = a3[e].contiguous(), b3[:, :, e].contiguous()
        if transposed:  # delta = (B_e A_e)ᵀ = A_eᵀ B_eᵀ: a LoRA with A' = B_eᵀ, B' = A_eᵀ
            a, b = b.T.contiguous(), a.T.contiguous()
        halves = (b[0::2], b[1::2]) if layout.interleaved_gate_up else (b[:inter], b[inter:])
        parts = ({layout.gate: halves[0], layout.up: halves[1]} if fused == "gate_up_proj" else {layout.down: b})
        out += [LoraModule(f"{disk}.experts.{e}.{proj}", "linear", a, part.contiguous(), rank, alpha, scale)
                for proj, part in parts.items()]
    return out


def expert_tensor(arch: ArchSpec) -> re.Pattern | None:
    """Matches a per-expert tensor on disk: groups (the block, the expert, the projection); None when dense."""
    layout = arch.experts
    return None if layout is None else re.compile(rf"^(.*\.{layout.disk_block})\.experts\.(\d+)\.(\w+)\.weight$")


def expert_bias(arch: ArchSpec) -> re.Pattern | None:
    """Matches a per-expert bias (gpt-oss): groups as :func:`expert_tensor`'s."""
    layout = arch.experts
    return None if layout is None else re.compile(rf"^(.*\.{layout.disk_block})\.experts\.(\d+)\.(\w+)\.bias$")


def disk_shapes(arch: ArchSpec, memory: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes a checkpoint stores for a model whose transformers 5 state dict has
    ``memory`` (fused experts split per expert, the router under its disk block); dense models unchanged."""
    if arch.experts is not None and arch.experts.stored_in_out:
        return memory  # gpt-oss and Llama 4 store their experts as transformers holds them
    views = fused_views(arch, memory)
    if not views:
        return memory
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in memory.items():
        out.update({disk: s for disk, s, _ in views[name]} if name in views else {name: shape})
    return out


def expert_groups(arch: ArchSpec, config: dict, names: list[str]) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Per-expert tensor -> (its MoE block, e.g. ``model.layers.0.block_sparse_moe``; its projection on disk,
    e.g. ``w1``; the tensors of that block and projection in expert order): what engines that stack a layer's
    experts (llama.cpp, mlx-lm) stack. A group missing an expert the config counts is refused."""
    layout, weights, biases = arch.experts, expert_tensor(arch), expert_bias(arch)
    if layout is None or weights is None or biases is None:
        return {}
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in names:
        if m := weights.match(name):
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = name
        elif m := biases.match(name):  # gpt-oss: stacked as the weights, under the projection's name + ".bias"
            groups.setdefault((m[1], f"{m[3]}.bias"), {})[int(m[2])] = name
    n = layout.expert_count(config)
    out = {}
    for (block, proj), members in groups.items():
        if sorted(members) != list(range(n)):
            missing = sorted(set(range(n)) - set(members))
            raise UserError(f"{block}.experts.*.{proj}: config.json counts {n} experts but the weights hold "
                            f"{'no expert ' + str(missing[0]) if missing else 'more'}",
                            "download the missing shards, or repair the expert count in config.json")
        order = tuple(members[e] for e in range(n))
        out.update({name: (block, proj, order) for name in order})
    return out


def stack_expert_loras(mods: dict[int, LoraModule], n_experts: int, rank: int, shape: tuple[int, int],
                       factor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's expert LoRAs of one projection stacked as llama.cpp and mlx-lm apply them (gathered by
    expert): ``a [E, rank, in]``, ``b [E, out, rank]`` with ``factor(mod)`` folded into each B; ranks below
    ``rank`` padded with zeros, experts without a LoRA all zeros. ``shape``: one expert's ``(out, in)``."""
    a = torch.zeros(n_experts, rank, shape[1])
    b = torch.zeros(n_experts, shape[0], rank)
    for e, mod in mods.items():
        a[e, :mod.rank] = mod.A.float()
        b[e, :, :mod.rank] = mod.B.float() * factor(mod)
    return a, b
