"""Granite: embedding, attention, residual and logit multipliers."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES
from ..mlx.arch_facts import MlxArch
from .spec import ArchSpec

# Granite's four multipliers, carried as llama.cpp's scales (Granite 3 and Granite 4's hybrid alike)
MULTIPLIER_HPARAMS = (
    ("embedding_scale", ("embedding_multiplier",), "f32"), ("residual_scale", ("residual_multiplier",), "f32"),
    ("attention.scale", ("attention_multiplier",), "f32"), ("logit_scale", ("logits_scaling",), "f32"))
MULTIPLIER_RULES = {
    "embedding_multiplier": KeyRule("carried", "embedding_scale"),
    "residual_multiplier": KeyRule("carried", "residual_scale"),
    "attention_multiplier": KeyRule("carried", "attention.scale"),
    "logits_scaling": KeyRule("carried", "logit_scale"),
}

def rope_switch(cfg: dict) -> dict[str, object]:
    """llama.cpp's granite graphs apply RoPE only while ``rope.scaling.finetuned`` (true when missing): Granite 3
    always, a Granite 4 by its ``position_embedding_type`` (the hybrids' "nope")."""
    return {"rope.scaling.finetuned": cfg.get("position_embedding_type", "rope") == "rope"}


ARCH = ArchSpec(
    "granite",
    ("GraniteForCausalLM",),
    gguf_arch="granite",
    rope_style="normal",
    notes=("embedding, attention, residual and logit multipliers (carried as GGUF scales)",),
    gguf=GGUFArch(COMMON_HPARAMS + MULTIPLIER_HPARAMS, {**COMMON, **NO_BIASES, **MULTIPLIER_RULES},
                  write_vocab_size=True, write_rope_dims=True, derived_hparams=rope_switch),
    mlx=MlxArch("granite"),
    awq=transformers_layout("granite", "Granite", embed_scale=lambda cfg: cfg.embedding_multiplier),
    refusals={"exl3": "exllamav3 has no architecture for GraniteForCausalLM"},
)
