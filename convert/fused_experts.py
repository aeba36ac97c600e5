"""transformers 5's fused expert tensors seen under the per-expert names checkpoints have always used.

transformers 5 keeps a layer's experts as 3-D parameters (``mlp.experts.gate_up_proj [E, 2I, H]`` whose rows
are the gate then the up projection, ``mlp.experts.down_proj [E, H, I]``) and the router as ``mlp.gate``. Its
``save_pretrained`` writes them back per expert, but a checkpoint saved from the state dict (or by tools that
skip that step) keeps them fused on disk. Each per-expert projection is a contiguous run of rows of the fused
tensor, so a reader can serve it without reading the rest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .arch import ArchSpec, ExpertLayout
from .tensors import TensorMeta


@dataclass(frozen=True)
class ExpertRows:
    """A per-expert tensor inside a fused ``[E, R, C]`` one: ``rows`` rows from ``row`` of expert ``expert`` of
    ``source``, which start at its flat element ``first`` (expert -1: the whole tensor, renamed)."""

    source: str
    expert: int = -1
    row: int = 0
    rows: int = 0
    first: int = 0
    # gpt-oss and Llama 4 (``ExpertLayout.stored_in_out``): the expert's whole slice is read, transposed to
    # [out, in] where stored [in, out], and ``rows`` rows kept from ``row``, every ``step``-th (gpt-oss's
    # interleaved gate and up: 2); ``scales``: the slice is MXFP4 blocks, decoded with the same rows of this tensor
    transposed: bool = False
    step: int = 1
    scales: str | None = None

    @property
    def strided(self) -> bool:
        """Read whole and cut (gpt-oss, Llama 4), not as one contiguous run of rows."""
        return self.transposed or self.step > 1 or self.scales is not None


FusedViews = dict[str, list[tuple[str, tuple[int, ...], ExpertRows]]]


def fused_views(arch: ArchSpec | None, shapes: dict[str, tuple[int, ...]]) -> FusedViews:
    """For each fused (or memory-named) expert tensor among ``shapes``: the disk names it stands for, each with
    its shape and where its rows lie. Empty for dense models and for
    checkpoints already stored per expert."""
    layout = arch.experts if arch is not None else None
    if layout is None:
        return {}
    if layout.stored_in_out:
        return _in_out_views(layout, shapes)
    fused = re.compile(
        rf"^(.*\.\d+)\.{layout.memory_block}\.(experts\.(gate_up_proj|down_proj)|{layout.router}\.weight)$")
    out: FusedViews = {}
    for name, shape in shapes.items():
        if (m := fused.match(name)) is None:
            continue
        disk = f"{m[1]}.{layout.disk_block}"
        if m[3] is None:  # the router: renamed where the block's disk name differs (Mixtral)
            if layout.memory_block != layout.disk_block:
                out[name] = [(f"{disk}.{layout.router}.weight", shape, ExpertRows(name))]
            continue
        if len(shape) != 3:
            continue
        n, rows, cols = shape
        halves = (((layout.gate, 0, rows // 2), (layout.up, rows // 2, rows // 2)) if m[3] == "gate_up_proj"
                  else ((layout.down, 0, rows),))
        out[name] = [(f"{disk}.experts.{e}.{proj}.weight", (r, cols),
                      ExpertRows(name, e, row, r, first=(e * rows + row) * cols))
                     for e in range(n) for proj, row, r in halves]
    return out


def _in_out_views(layout: ExpertLayout, shapes: dict[str, tuple[int, ...]]) -> FusedViews:
    """Experts stored fused [E, in, out] (gpt-oss's weights, biases, MXFP4 blocks; Llama 4's weights) as one
    tensor per expert, gate and up apart; the MXFP4 scales are read with their blocks (no name of their own)."""
    fused = re.compile(
        rf"^(.*\.\d+)\.{layout.memory_block}\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
    out: FusedViews = {}
    for name, shape in shapes.items():
        if (m := fused.match(name)) is None:
            continue
        kind = m[3] or ""
        if kind == "_scales":
            out[name] = []
            continue
        if len(shape) != {"": 3, "_bias": 2, "_blocks": 4}[kind]:
            continue
        n, per_expert = shape[0], math.prod(shape[1:])
        if kind == "_blocks":  # [E, out, in / 32, 16]
            rows, tail = shape[1], (shape[2] * shape[3] * 2,)
        elif kind == "":  # [E, in, out]
            rows, tail = shape[2], (shape[1],)
        else:  # [E, out]
            rows, tail = shape[1], ()
        half = rows // 2  # (projection, first row, rows, step) of each part
        if m[2] == "down_proj":
            parts = ((layout.down, 0, rows, 1),)
        elif layout.interleaved_gate_up:  # gpt-oss: gate0, up0, gate1, ...
            parts = ((layout.gate, 0, half, 2), (layout.up, 1, half, 2))
        else:  # Llama 4: the gate half, then the up half
            parts = ((layout.gate, 0, half, 1), (layout.up, half, half, 1))
        suffix = "bias" if kind == "_bias" else "weight"
        out[name] = [(f"{m[1]}.{layout.disk_block}.experts.{e}.{proj}.{suffix}", (r, *tail),
                      ExpertRows(name, e, row, r, first=e * per_expert, transposed=kind == "", step=step,
                                 scales=name.removesuffix("_blocks") + "_scales" if kind == "_blocks" else None))
                      for e in range(n) for proj, row, r, step in parts]
    return out


def fuse_to_memory(arch: ArchSpec | None, tensors: dict) -> dict:
    """``tensors`` (per-expert disk names) under transformers 5's in-memory names: each block's experts stacked
    into ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up) and ``experts.down_proj [E, H, I]``, the
    router under the memory block. The inverse of :func:`fused_views`; other tensors pass through."""
    import torch

    layout = arch.experts if arch is not None else None
    if layout is None:
        return tensors
    if layout.stored_in_out:
        return _fuse_in_out(layout, tensors)
    # with a layer prefix, or relative to a layer
    per_expert = re.compile(rf"^(.*\.)?{layout.disk_block}\.experts\.(\d+)\.(\w+)\.weight$")
    router = re.compile(rf"^(.*\.)?{layout.disk_block}\.{layout.router}\.weight$")
    out, blocks = {}, {}
    for name, t in tensors.items():
        if m := per_expert.match(name):
            blocks.setdefault(m[1] or "", {})[int(m[2]), m[3]] = t
        elif m := router.match(name):
            out[f"{m[1] or ''}{layout.memory_block}.{layout.router}.weight"] = t
        else:
            out[name] = t
    for layer, parts in blocks.items():
        n = 1 + max(e for e, _ in parts)
        prefix = f"{layer}{layout.memory_block}.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, layout.gate], parts[e, layout.up]])
                                                     for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, layout.down] for e in range(n)])
    return out


def _fuse_in_out(layout: ExpertLayout, tensors: dict) -> dict:
    """Per-expert tensors back into the fused [in, out] layout (the inverse of :func:`_in_out_views`): weights
    ``[E, in, out]`` with the gate and up columns interleaved (gpt-oss) or as two halves (Llama 4), biases
    ``[E, out]``."""
    import torch

    per_expert = re.compile(rf"^(.*\.)?{layout.disk_block}\.experts\.(\d+)\.(\w+)\.(weight|bias)$")
    out, blocks = {}, {}
    for name, t in tensors.items():
        if m := per_expert.match(name):
            blocks.setdefault(m[1] or "", {})[int(m[2]), m[3], m[4]] = t
        else:
            out[name] = t
    for layer, parts in blocks.items():
        n = 1 + max(e for e, _, _ in parts)
        prefix = f"{layer}{layout.memory_block}.experts"
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            if (0, layout.gate, kind) in parts:
                pairs = [(parts[e, layout.gate, kind], parts[e, layout.up, kind]) for e in range(n)]
                gate_up = torch.stack([torch.stack(p, dim=1).flatten(0, 1) if layout.interleaved_gate_up
                                       else torch.cat(p) for p in pairs])  # rows gate0, up0, gate1, ... or halves
                out[f"{prefix}.gate_up_proj{suffix}"] = gate_up.transpose(1, 2) if kind == "weight" else gate_up
            if (0, layout.down, kind) in parts:
                down = torch.stack([parts[e, layout.down, kind] for e in range(n)])
                out[f"{prefix}.down_proj{suffix}"] = down.transpose(1, 2) if kind == "weight" else down
    return {k: v.contiguous() for k, v in out.items()}


class DiskFuser:
    """Writes per-expert tensors (what readers see) in a checkpoint layout that keeps experts fused (gpt-oss,
    Llama 4): each fused tensor is planned where its last part comes and produced once all its parts have; other
    tensors pass."""

    def __init__(self, arch: ArchSpec | None, specs: list[TensorMeta]) -> None:
        import torch

        layout = arch.experts if arch is not None else None
        self.layout = layout if layout is not None and layout.stored_in_out else None
        self.pending: dict[str, dict[str, object]] = {}  # fused name -> its parts so far
        self.parts_of: dict[str, str] = {}  # per-expert name -> the fused tensor it is part of
        self.count: dict[str, int] = {}
        self.specs: list[TensorMeta] = []
        if self.layout is None:
            self.specs = list(specs)
            return
        per_expert = re.compile(rf"^(.*\.){self.layout.disk_block}\.experts\.\d+\.(\w+)\.(weight|bias)$")
        groups: dict[str, list[TensorMeta]] = {}
        for s in specs:
            if m := per_expert.match(s.name):
                fused = "gate_up_proj" if m[2] in (self.layout.gate, self.layout.up) else "down_proj"
                fused = f"{m[1]}{self.layout.memory_block}.experts.{fused}" + ("_bias" if m[3] == "bias" else "")
                groups.setdefault(fused, []).append(s)
                self.parts_of[s.name] = fused
        last = {members[-1].name: fused for fused, members in groups.items()}
        for s in specs:
            if s.name not in self.parts_of:
                self.specs.append(s)
            elif s.name in last:
                fused = last[s.name]
                members = groups[fused]
                meta = _fuse_in_out(self.layout, {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta")
                                                       for m in members})[fused]
                self.specs.append(TensorMeta(fused, s.dtype, tuple(meta.shape)))
                self.count[fused] = len(members)

    def feed(self, name: str, tensor) -> list[tuple[str, object]]:
        """The tensors ready to write once ``name`` is produced."""
        fused = self.parts_of.get(name)
        if fused is None:
            return [(name, tensor)]
        parts = self.pending.setdefault(fused, {})
        parts[name] = tensor
        if len(parts) < self.count[fused]:
            return []
        del self.pending[fused]
        return list(_fuse_in_out(self.layout, parts).items())  # type: ignore[arg-type]
