"""Gemma 3's text model (1B, and the text tower of 4B-27B): every 6th layer global, its own RoPE base for the
sliding layers, norms stored as w - 1."""

from ..calibration.layouts import GEMMA_GROUPS, AWQArch, gemma_embed_scale
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, gemma_rules
from ..mlx.arch_facts import MlxArch, gemma3_rope_and_windows, gemma_embed_factor
from .spec import ArchSpec

ARCH = ArchSpec(
    "gemma3_text",
    ("Gemma3ForCausalLM",),
    gguf_arch="gemma3",
    rope_style="neox",
    notes=("norm weights stored as w - 1", "embeddings scaled by sqrt(hidden)", "sliding-window layers"),
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING, {
        **COMMON, **gemma_rules(3, global_every=6),
        "query_pre_attn_scalar": KeyRule("folded", "attn_q_norm multiplied by sqrt(d / query_pre_attn_scalar), "
                                         "d the size llama.cpp scales queries by"),
        "_sliding_window_pattern": KeyRule("inert", "layer_types is what counts"),
        # transformers 4's layout of the same settings
        "sliding_window_pattern": KeyRule("refused unless", "6", must_be(
            6, why="llama.cpp makes every 6th layer global (set_swa_pattern(6))")),
        "rope_local_base_freq": KeyRule("carried", "rope.freq_base_swa"),
        "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping"),
        "attn_logit_softcapping": KeyRule("refused unless", "none", must_be(
            None, why="llama.cpp's Gemma 3 graph does not soft-cap attention logits")),
    }, norm_offset=1.0, write_freq_base_swa=True, softcap=True, query_fold="q_norm",
        hidden_scaled_queries_at_layers=62),
    mlx=MlxArch("gemma3_text", (gemma3_rope_and_windows,), embed_factor=gemma_embed_factor, norm_offset=1.0,
                notes=("embedding rows scaled by the ratio of sqrt(hidden) to mlx-lm's bfloat16 rounding of it",),
                fixed_rules={"layer_types": KeyRule("carried", "as sliding_window_pattern"),
                             "_sliding_window_pattern": KeyRule("inert", "layer_types is what counts")}),
    awq=AWQArch("transformers.models.gemma3.modeling_gemma3", "Gemma3DecoderLayer", "Gemma3RotaryEmbedding",
                "Gemma3RMSNorm", groups=GEMMA_GROUPS, embed_scale=gemma_embed_scale),
    exl3=True,
)
