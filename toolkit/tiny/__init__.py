"""Deterministic tiny models, tokenizers and PEFT adapters, built locally (no network).

Used by ``tuneport demo``, the tests and the benchmarks. :class:`TinyZoo` builds each on first use
and reuses it afterwards.
"""

from __future__ import annotations

from pathlib import Path

from .adapters import ADDED_TOKENS, VARIANTS, Variant, make_adapter
from .corpus import EVAL_TEXT, PROMPTS
from .models import TINY_ARCHS, WIDE_DIMS, make_base

__all__ = ["ADDED_TOKENS", "EVAL_TEXT", "PROMPTS", "TINY_ARCHS", "VARIANTS", "TinyZoo", "Variant",
           "make_adapter", "make_base"]


class TinyZoo:
    """Tiny bases and adapters under ``root``, made on demand.

    ``zoo.base("llama")``, ``zoo.adapter("qwen2", "dora")``.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def base(self, arch: str, dtype: str = "fp32", tied: bool = False, wide: bool = False) -> Path:
        """``wide``: hidden 256 / intermediate 512, so every row suits llama.cpp's K-quants (blocks of 256)."""
        out = self.root / f"{arch}-{dtype}{'-tied' if tied else ''}{'-wide' if wide else ''}"
        if not (out / "config.json").exists():
            make_base(arch, out, dtype=dtype, tied=tied, dims=WIDE_DIMS if wide else None)
        return out

    def tool_base(self, arch: str = "qwen2") -> Path:
        """``base(arch)`` (same weights, so its adapters apply) with a chat template that renders tools in the
        Hermes syntax (<tool_call>...</tool_call>), and 2,048 positions: a tool prompt is long in a tiny vocabulary."""
        import json
        import shutil

        from .tokenizers import TOOLS_TEMPLATE

        out = self.root / f"{arch}-fp32-tools"
        if not (out / "config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(self.base(arch), tmp)
            (tmp / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}, indent=2))
            tmp.rename(out)
        return out

    def fused_base(self, arch: str) -> Path:
        """``base(arch)`` (same weights) saved as transformers 5 holds a mixture of experts in memory: each
        layer's experts fused (``mlp.experts.gate_up_proj``, ``down_proj``), the router as ``mlp.gate``."""
        import shutil

        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        out = self.root / f"{arch}-fp32-fused"
        if not (out / "config.json").exists():
            src, tmp = self.base(arch), out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
            state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
                     or not model.config.tie_word_embeddings}
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
            tmp.rename(out)
        return out

    def adapter(self, arch: str, variant: str, dtype: str = "fp32", wide: bool = False) -> Path:
        out = self.root / "adapters" / f"{arch}-{dtype}-{variant}{'-wide' if wide else ''}"
        if not (out / "adapter_config.json").exists():
            make_adapter(self.base_for(arch, variant, dtype, wide), variant, out)
        return out

    def base_for(self, arch: str, variant: str, dtype: str = "fp32", wide: bool = False) -> Path:
        """The base an adapter variant was made on (tied bases for the tied variant)."""
        spec = VARIANTS.get(variant)
        return self.base(arch, dtype, tied=spec is not None and spec.tied_base, wide=wide)
