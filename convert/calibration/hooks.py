"""Which modules a calibration pass records: the first linear of each group that shares an input, and a
mixture-of-experts block's per-expert linears under their checkpoint names (AWQ and the importance matrix)."""

from __future__ import annotations

from .blocks import Block
from .layouts import AWQArch


def hooked_modules(arch: AWQArch) -> tuple[str, ...]:
    """The module whose input is recorded for each scale group (its linears share that input)."""
    return tuple(g.linears[0] for g in arch.groups)


def expert_modules(block: Block) -> dict[tuple[int, str], str]:
    """(expert, projection on disk) -> the per-expert module's checkpoint name, for a mixture-of-experts block."""
    layout, experts = block.experts, block.module.get_submodule(f"{block.experts.memory_block}.experts")
    return {(e, p): f"{block.prefix}{layout.disk_block}.experts.{e}.{p}"
            for e in range(experts.gate_up_proj.shape[0]) for p in (layout.gate, layout.up, layout.down)}
