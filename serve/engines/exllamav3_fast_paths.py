"""exllamav3's fused decode paths, which bypass ``Linear.forward`` and with it LoRA: found on the loaded model and
switched off while an adapter set is active (see :mod:`tuneport.serve.engines.exllamav3`)."""

from __future__ import annotations

import logging

log = logging.getLogger("tuneport.serve.exllamav3")


class FastPaths:
    """exllamav3's fused decode paths that skip ``Linear.forward`` (and so LoRA), found on the loaded model:
    ``off()`` while adapters are registered, ``on()`` again for the base.

    What exllamav3 1.4 (``modules/attn.py``, ``sliding_attn.py``, ``mlp.py``) has, each optional and checked at
    every forward (so setting it to None takes the per-``Linear`` path): ``multi_kv`` / ``multi_qg`` (paired
    projections as one mgemm for up to 32 rows, prefill included), ``multi_qkv`` (a later sliced Q/K/V bundle,
    when present), ``GatedMLP.multi_gu`` (a list per slice), ``MLP.bc`` / ``GatedMLP.bc`` (graphed MLPs), and the
    graph-captured decode attention, gated by the module global ``_bc_attn_enable`` that ``attn.py`` and
    ``sliding_attn.py`` each import from ``attention_fn/bc_attn.py`` and read at every decode step."""

    ATTRS = ("multi_kv", "multi_qg", "multi_qkv")
    BC_CLASSES = ("MLP", "GatedMLP")
    FLAG_MODULES = ("exllamav3.modules.attn", "exllamav3.modules.sliding_attn")
    FLAG = "_bc_attn_enable"

    def __init__(self, model) -> None:
        import importlib

        self.flags: list[tuple[object, object]] = []  # (module with FLAG, its value at load)
        for name in self.FLAG_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, self.FLAG):
                self.flags.append((mod, getattr(mod, self.FLAG)))
        self.saved: list[tuple[object, str, object]] = []
        for m in model:
            for attr in self.ATTRS:
                if getattr(m, attr, None) is not None:
                    self.saved.append((m, attr, getattr(m, attr)))
            if isinstance(getattr(m, "multi_gu", None), list) and any(x is not None for x in m.multi_gu):
                self.saved.append((m, "multi_gu", list(m.multi_gu)))
            if type(m).__name__ in self.BC_CLASSES and getattr(m, "bc", None) is not None:
                self.saved.append((m, "bc", m.bc))
        if not self.flags:
            log.warning("exllamav3 has no %s flag in %s: its graph-captured decode attention, if any, cannot be "
                        "switched off and may skip adapters (check with benchmarks/gpu/exllamav3_adapters.py)",
                        self.FLAG, " or ".join(self.FLAG_MODULES))
        self.enabled = True

    def off(self) -> None:
        if self.enabled:
            for m, attr, value in self.saved:
                setattr(m, attr, [None] * len(value) if isinstance(value, list) else None)
            for mod, _ in self.flags:
                setattr(mod, self.FLAG, False)
            self.enabled = False

    def on(self) -> None:
        if not self.enabled:
            for m, attr, value in self.saved:
                setattr(m, attr, list(value) if isinstance(value, list) else value)
            for mod, value in self.flags:
                setattr(mod, self.FLAG, value)
            self.enabled = True

    def describe(self) -> dict:
        return {"switched": len(self.saved), "attention_graph_flags": len(self.flags)}
