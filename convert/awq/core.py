"""AWQ on one decoder block: search and fold the scales of each group, clip, quantize, pack."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..calibration.blocks import Block
from ..calibration.hooks import expert_modules
from ..calibration.layouts import AWQArch
from .formats import AWQFormat
from .quant import QuantScheme, quantize
from .search import apply_clip, search_clip, search_scale


@dataclass
class BlockResult:
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor to write
    quantized: set[str] = field(default_factory=set)  # modules written in 4 bits
    groups: list[dict] = field(default_factory=list)  # per scale group: alpha, loss vs round-to-nearest
    # module -> {"input_scale": s, "output_scale": s}: what its input / output is divided by inside the model
    scales: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


@torch.no_grad()
def fold_scales(block: Block, arch: AWQArch, scheme: QuantScheme, quantized: set[str],
                result: BlockResult) -> dict[str, torch.Tensor]:
    """Search each group's scale and fold it into the block (the float function is unchanged); return each
    linear's sampled input as the scaled block sees it (for the clip search)."""
    layer = block.module
    inputs: dict[str, torch.Tensor] = {}
    for group in arch.groups:
        names = [n for n in group.linears if block.prefix + n in quantized]
        stats = block.stats[group.linears[0]]
        x = stats.sample()
        for n in group.linears:
            inputs[n] = x
        if group.prev is None or not names:
            continue  # nothing to fold into (OLMo 2's q/k/v), or nothing quantized: no scale
        prev = layer.get_submodule(group.prev)
        mods = [layer.get_submodule(n) for n in group.linears]
        rows = group.prev_rows(block.config) if group.prev_rows else slice(None)
        if len(range(prev.weight.shape[0])[rows]) != mods[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention: shapes differ, no fold
        found = search_scale(x, stats.mean_abs, [layer.get_submodule(n).weight for n in names], scheme)
        s = found.scale
        if group.prev_kind == "norm":
            prev.weight.div_(s)
        elif group.prev_kind == "norm_plus_one":  # Gemma computes with 1 + w
            prev.weight.copy_((1 + prev.weight) / s - 1)
        else:
            out_scale = torch.ones(prev.weight.shape[0])  # what each output row of prev is divided by
            out_scale[rows] = s
            prev.weight.div_(out_scale.view(-1, 1))
            if getattr(prev, "bias", None) is not None:
                prev.bias.div_(out_scale)
            result.scales.setdefault(block.prefix + group.prev, {})["output_scale"] = out_scale
        for n, m in zip(group.linears, mods, strict=True):
            m.weight.mul_(s.view(1, -1))
            result.scales.setdefault(block.prefix + n, {})["input_scale"] = s.clone()
        xs = x / s
        for n in group.linears:
            inputs[n] = xs
        result.groups.append({"group": group.linears, "alpha": found.alpha,
                              "loss_vs_rtn": found.loss / found.loss_unscaled if found.loss_unscaled else 1.0})
    return inputs


def _expert_weights(experts: torch.nn.Module, layout, e: int) -> dict[str, torch.Tensor]:
    inter = experts.gate_up_proj.shape[1] // 2
    return {layout.gate: experts.gate_up_proj[e, :inter], layout.up: experts.gate_up_proj[e, inter:],
            layout.down: experts.down_proj[e]}


@torch.no_grad()
def fold_expert_scales(block: Block, arch: AWQArch, scheme: QuantScheme, quantized: set[str], result: BlockResult,
                       dense_inputs: dict[str, torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """A mixture-of-experts block: one scale for the input the router and every expert's gate/up share (folded
    into ``arch.moe_norm``, the router's columns multiplied by it so that routing is unchanged, and those of
    ``arch.moe_shared``, the shared expert's linears, whose ``dense_inputs`` are divided by it), searched on each
    expert's own tokens (the shared expert's: every token); then each expert's down_proj scale, folded into its
    up rows. Returns each expert projection's sampled input as the scaled block sees it. An expert no calibration
    token reached keeps scale 1 for its down_proj (and no clipping)."""
    layout, layer = block.experts, block.module
    experts = layer.get_submodule(f"{layout.memory_block}.experts")
    router = layer.get_submodule(f"{layout.memory_block}.{layout.router}")
    names = expert_modules(block)
    n, inter = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1] // 2
    reached = [e for e in range(n) if f"experts.{e}" in block.stats]
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    if reached and all(names[e, p] in quantized for e in reached for p in (layout.gate, layout.up)):
        xs = [block.stats[f"experts.{e}"].sample() for e in reached]
        shared = [n for n in arch.moe_shared if block.prefix + n in quantized and n in dense_inputs]
        found = search_scale(xs + [dense_inputs[n] for n in shared], block.stats["experts"].mean_abs,
                             [experts.gate_up_proj[e] for e in reached] + [layer.get_submodule(n).weight
                                                                          for n in shared], scheme)
        s = found.scale
        layer.get_submodule(arch.moe_norm).weight.div_(s)
        router.weight.mul_(s.view(1, -1))
        experts.gate_up_proj.mul_(s.view(1, 1, -1))
        for name in arch.moe_shared:
            layer.get_submodule(name).weight.mul_(s.view(1, -1))
            result.scales.setdefault(block.prefix + name, {})["input_scale"] = s.clone()
            if name in dense_inputs:
                dense_inputs[name] = dense_inputs[name] / s
        for e, x in zip(reached, xs, strict=True):
            inputs[e, layout.gate] = inputs[e, layout.up] = x / s
        result.groups.append({"group": (f"{layout.memory_block}.experts.*.gate_up",), "alpha": found.alpha,
                              "loss_vs_rtn": found.loss / found.loss_unscaled if found.loss_unscaled else 1.0})
    for e in reached:
        st = block.stats[f"experts.{e}.down"]
        x = st.sample()
        if names[e, layout.down] not in quantized:
            continue
        found = search_scale(x, st.mean_abs, [experts.down_proj[e]], scheme)
        s = found.scale
        experts.gate_up_proj[e, inter:].div_(s.view(-1, 1))
        experts.down_proj[e].mul_(s.view(1, -1))
        inputs[e, layout.down] = x / s
        result.groups.append({"group": (f"{layout.memory_block}.experts.{e}.down_proj",), "alpha": found.alpha,
                              "loss_vs_rtn": found.loss / found.loss_unscaled if found.loss_unscaled else 1.0})
    return inputs


@torch.no_grad()
def _quantize_experts(block: Block, arch: AWQArch, scheme: QuantScheme, fmt: AWQFormat, quantized: set[str],
                      out_dtype: torch.dtype, awq: bool, result: BlockResult,
                      dense_inputs: dict[str, torch.Tensor]) -> None:
    """Each expert's projections written under the checkpoint's per-expert names (4-bit where ``quantized``),
    the router under its disk name, 16-bit."""
    layout, layer = block.experts, block.module
    inputs = fold_expert_scales(block, arch, scheme, quantized, result, dense_inputs) if awq else {}
    experts = layer.get_submodule(f"{layout.memory_block}.experts")
    for (e, proj), name in expert_modules(block).items():
        w = _expert_weights(experts, layout, e)[proj]
        if name not in quantized:
            result.tensors[f"{name}.weight"] = w.to(out_dtype)
            continue
        if awq and (e, proj) in inputs:
            w = apply_clip(w, search_clip(inputs[e, proj], w, scheme), scheme.group_size)
        result.quantized.add(name)
        result.tensors.update(fmt.pack(quantize(w, scheme), name))
    router = layer.get_submodule(f"{layout.memory_block}.{layout.router}").weight
    result.tensors[f"{block.prefix}{layout.disk_block}.{layout.router}.weight"] = router.to(out_dtype)


@torch.no_grad()
def quantize_block(block: Block, arch: AWQArch, scheme: QuantScheme, fmt: AWQFormat, quantized: set[str],
                   out_dtype: torch.dtype, awq: bool = True) -> BlockResult:
    """``quantized``: full module names to write in 4 bits. ``awq=False`` is plain round-to-nearest."""
    layer = block.module
    result = BlockResult({})
    inputs = fold_scales(block, arch, scheme, quantized, result) if awq else {}
    moe: str | None = None
    if arch.moe_norm is not None and block.experts is not None:
        _quantize_experts(block, arch, scheme, fmt, quantized, out_dtype, awq, result, inputs)
        moe = f"{block.experts.memory_block}."  # its tensors are written above, under their disk names
    for name in arch.linears:
        full = block.prefix + name
        if full not in quantized:
            continue
        w = layer.get_submodule(name).weight
        if awq and name not in arch.no_clip:
            w = apply_clip(w, search_clip(inputs[name], w, scheme), scheme.group_size)
        result.quantized.add(full)
        result.tensors.update(fmt.pack(quantize(w, scheme), full))
        del w
    for key, t in layer.state_dict().items():
        full = block.prefix + key
        if key.endswith(".weight") and full[: -len(".weight")] in quantized:
            continue
        if moe is not None and key.startswith(moe) and (
                ".experts." in key or key.endswith(f".{block.experts.router}.weight")):
            continue
        result.tensors[full] = t.to(out_dtype) if t.is_floating_point() else t
    return result
