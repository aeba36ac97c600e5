"""transformers 5's fused expert tensors seen under the per-expert names checkpoints have always used.

transformers 5 keeps a layer's experts as 3-D parameters (``mlp.experts.gate_up_proj [E, 2I, H]`` whose rows
are the gate then the up projection, ``mlp.experts.down_proj [E, H, I]``) and the router as ``mlp.gate``. Its
``save_pretrained`` writes them back per expert, but a checkpoint saved from the state dict (or by tools that
skip that step) keeps them fused on disk. Each per-expert projection is a contiguous run of rows of the fused
tensor, so a reader can serve it without reading the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .arch import ArchSpec


@dataclass(frozen=True)
class ExpertRows:
    """A per-expert tensor inside a fused ``[E, R, C]`` one: ``rows`` rows from ``row`` of expert ``expert`` of
    ``source``, which start at its flat element ``first`` (expert -1: the whole tensor, renamed)."""

    source: str
    expert: int = -1
    row: int = 0
    rows: int = 0
    first: int = 0


FusedViews = dict[str, list[tuple[str, tuple[int, ...], ExpertRows]]]


def fused_views(arch: ArchSpec | None, shapes: dict[str, tuple[int, ...]]) -> FusedViews:
    """For each fused (or memory-named) expert tensor among ``shapes``: the disk names it stands for, each with
    its shape and where its rows lie. Empty for dense models and for
    checkpoints already stored per expert."""
    layout = arch.experts if arch is not None else None
    if layout is None:
        return {}
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


def fuse_to_memory(arch: ArchSpec | None, tensors: dict) -> dict:
    """``tensors`` (per-expert disk names) under transformers 5's in-memory names: each block's experts stacked
    into ``experts.gate_up_proj [E, 2I, H]`` (gate rows, then up) and ``experts.down_proj [E, H, I]``, the
    router under the memory block. The inverse of :func:`fused_views`; other tensors pass through."""
    import torch

    layout = arch.experts if arch is not None else None
    if layout is None:
        return tensors
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
