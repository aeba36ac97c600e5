"""Linears a checkpoint keeps fused that an engine keeps apart: Granite's ``shared_mlp.input_linear`` (the gate rows,
then the up rows) is llama.cpp's ``ffn_gate`` and ``ffn_up`` and mlx-lm's ``mlp.gate_proj`` and ``mlp.up_proj``. An
architecture names them per config (``ArchSpec.split_linears``, each a ``SplitLinear``): the GGUF and MLX writers
write each part under its own name (Granite 4's routed experts in mlx-lm's ``switch_mlp`` names, as only MLX writes
them), and a LoRA on the fused linear becomes one LoRA per part (the same A, B's rows cut alike)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .adapter import LoraModule
    from .arch import ArchSpec


@dataclass(frozen=True)
class Part:
    module: str  # the part's module path
    index: int
    count: int

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This part's rows of the fused weight ``[out, in]``, of stacked experts' ``[E, out, in]``, or of a LoRA's
        B."""
        return t.chunk(self.count, dim=max(t.dim() - 2, 0))[self.index].contiguous()

    def shape(self, fused: tuple[int, ...]) -> tuple[int, ...]:
        """The part's shape in a fused weight of shape ``fused`` (its rows: the next-to-last axis, or the only one)."""
        axis = max(len(fused) - 2, 0)
        return (*fused[:axis], fused[axis] // self.count, *fused[axis + 1:])


def module_parts(arch: ArchSpec, config: dict, module: str) -> list[Part] | None:
    """The parts of the fused linear ``module`` (a module path), or None where ``module`` is not one."""
    if arch.split_linears is None:
        return None
    for split in arch.split_linears(config):
        if module.endswith(f".{split.fused}"):
            stem = module[: -len(split.fused)]
            return [Part(stem + p, i, len(split.parts)) for i, p in enumerate(split.parts)]
    return None


def tensor_parts(arch: ArchSpec, config: dict, name: str) -> list[tuple[str, Part]] | None:
    """(part tensor name, part) for the fused weight or bias ``name``; None where it is not one."""
    module, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias") or (parts := module_parts(arch, config, module)) is None:
        return None
    return [(f"{p.module}.{kind}", p) for p in parts]


def split_lora_modules(arch: ArchSpec, config: dict, modules: Iterable[LoraModule]) -> list[LoraModule]:
    """``modules`` with each LoRA on a fused linear replaced by one per part (its A, its B's rows of that part)."""
    out = []
    for mod in modules:
        parts = module_parts(arch, config, mod.module)
        if parts is None:
            out.append(mod)
            continue
        out += [replace(mod, module=p.module, B=p.rows(mod.B),
                        magnitude=None if mod.magnitude is None else p.rows(mod.magnitude),
                        bias=None if mod.bias is None else p.rows(mod.bias)) for p in parts]
    return out


def part_shape(arch: ArchSpec, config: dict, shape_of: Callable[[str], tuple[int, ...] | None], name: str
               ) -> tuple[int, ...] | None:
    """The shape of the part tensor ``name`` from its fused weight's (``shape_of``: a tensor's shape or None);
    None where ``name`` is no part."""
    if arch.split_linears is None:
        return None
    for split in arch.split_linears(config):
        for part in split.parts:
            if name.endswith(f".{part}.weight"):
                fused = shape_of(name[: -len(f"{part}.weight")] + f"{split.fused}.weight")
                if fused is not None:
                    return Part(name, 0, len(split.parts)).shape(fused)
    return None
