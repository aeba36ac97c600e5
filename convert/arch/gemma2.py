"""Gemma 2: soft-capped attention and logits, every 2nd layer global, norms stored as w - 1."""

from ..calibration.layouts import GEMMA_GROUPS, gemma_embed_scale, transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, gemma_rules
from .spec import ArchSpec


def _softcap(value, cfg: dict) -> str | None:
    return None if value else "llama.cpp always soft-caps Gemma 2's logits (50 and 30 when the GGUF gives none)"


ARCH = ArchSpec(
    "gemma2",
    ("Gemma2ForCausalLM",),
    gguf_arch="gemma2",
    rope_style="neox",
    notes=("norm weights stored as w - 1", "embeddings scaled by sqrt(hidden)", "attention and final logit "
           "soft-capping", "every 2nd layer global, the others sliding-window",
           "the reference runs transformers' eager attention: its default sdpa drops attn_logit_softcapping "
           "(measured: logits 8.8e-3 apart on the tiny model)"),
    reference_attention="eager",
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING, {
        **COMMON, **gemma_rules(2, global_every=2),
        "tie_word_embeddings": KeyRule("refused unless", "true", must_be(
            True, why="llama.cpp's Gemma 2 has no output tensor: it reuses token_embd")),
        "query_pre_attn_scalar": KeyRule("folded", "attn_q rows (and a q_proj LoRA's B) multiplied by "
                                         "sqrt(d / query_pre_attn_scalar): Gemma 2 has no q norm"),
        "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping", _softcap),
        "attn_logit_softcapping": KeyRule("carried", "attn_logit_softcapping", _softcap),
    }, norm_offset=1.0, softcap=True, attn_softcap=True, query_fold="q_proj", hidden_scaled_queries_at_layers=46),
    awq=transformers_layout("gemma2", "Gemma2", GEMMA_GROUPS, embed_scale=gemma_embed_scale),
    exl3=True,
    refusals={"mlx": "mlx-lm's Gemma 2 has no sliding window, so past the window its outputs differ"},
)
