"""Architecture knowledge as data: one module per Hugging Face ``model_type`` in this package, each holding
the architecture's ``ARCH`` entry with every target's facts (GGUF names and rules, MLX model and fixes, the
calibration layout, EXL3, a multimodal text tower) and why a target refuses it.

Adding an architecture is adding a module here (``ARCH = ArchSpec(...)``) and its tiny model
(``toolkit/tiny/models.py``); the per-target tables (``GGUF_ARCHS``, ``MLX_ARCHS``, ``AWQ_ARCHS``, ...), the
support matrix and ``docs/architectures.md`` are views of ``ARCHS``.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UserError
from .spec import ATTENTION_LINEARS, LLAMA_LINEARS, ArchSpec, ExpertLayout, TextTower

__all__ = ["ARCHS", "ATTENTION_LINEARS", "LLAMA_LINEARS", "ArchSpec", "ExpertLayout", "TextTower", "arch_for",
           "known_arch", "target_refusal"]

NOT_ENTRIES = frozenset({"spec"})  # modules of this package that hold no architecture


def _entries() -> dict[str, ArchSpec]:
    table: dict[str, ArchSpec] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_ENTRIES):
        entry = importlib.import_module(f"{__name__}.{module}").ARCH
        if entry.model_type != module:
            raise RuntimeError(f"convert/arch/{module}.py holds the entry of {entry.model_type!r}")
        table[module] = entry
    return table


ARCHS: dict[str, ArchSpec] = _entries()


def arch_for(model_type: str | None) -> ArchSpec:
    """The entry for ``model_type``, or a UserError that lists the supported ones."""
    if not model_type:
        raise UserError("config.json names no model_type",
                        f"add the model_type of its architecture (tuneport supports: {', '.join(sorted(ARCHS))})")
    try:
        return ARCHS[str(model_type)]
    except KeyError:
        raise UserError(
            f"unsupported architecture {model_type!r}",
            f"tuneport supports: {', '.join(sorted(ARCHS))}",
        ) from None


def known_arch(model_type: str | None) -> ArchSpec | None:
    return ARCHS.get(str(model_type))


def target_refusal(model_type: str, target: str) -> str | None:
    """Why ``target`` ("gguf", "mlx", "awq", "exl3") refuses ``model_type``, or None: its entry holds no facts
    for the target."""
    arch = known_arch(model_type)
    if arch is not None and getattr(arch, target):
        return None
    default = f"no {target.upper()} table entry"
    return arch.refusals.get(target, default) if arch is not None else default
