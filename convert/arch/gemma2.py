"""Gemma 2: soft-capped attention and logits, every 2nd layer global, norms stored as w - 1."""

from ..calibration.layouts import GEMMA_GROUPS, gemma_embed_scale, transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON
from .spec import ArchSpec


def _softcap(value, cfg: dict) -> str | None:
    return None if value else "llama.cpp always soft-caps Gemma 2's logits (50 and 30 when the GGUF gives none)"


def _every_2nd_global(value, cfg: dict) -> str | None:
    want = ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(len(value))]
    return None if list(value) == want else ("llama.cpp makes every 2nd layer global (set_swa_pattern(2)); this "
                                             f"model's layer_types differ: {value}")


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
        **COMMON,
        "hidden_act": KeyRule("inert", "Gemma 2 reads hidden_activation"),
        "tie_word_embeddings": KeyRule("refused unless", "true", must_be(
            True, why="llama.cpp's Gemma 2 has no output tensor: it reuses token_embd")),
        "hidden_activation": KeyRule("refused unless", "gelu_pytorch_tanh", must_be(
            "gelu_pytorch_tanh", why="llama.cpp's Gemma 2 graph uses tanh-GELU")),
        "query_pre_attn_scalar": KeyRule("folded", "attn_q rows (and a q_proj LoRA's B) multiplied by "
                                         "sqrt(d / query_pre_attn_scalar): Gemma 2 has no q norm"),
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": KeyRule("refused unless", "every 2nd layer global", _every_2nd_global),
        "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping", _softcap),
        "attn_logit_softcapping": KeyRule("carried", "attn_logit_softcapping", _softcap),
        "use_bidirectional_attention": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp runs Gemma 2 causally")),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, why="llama.cpp's Gemma 2 graph has no attention biases")),
    }, norm_offset=1.0, softcap=True, attn_softcap=True, query_fold="q_proj", hidden_scaled_queries_at_layers=46),
    awq=transformers_layout("gemma2", "Gemma2", GEMMA_GROUPS, embed_scale=gemma_embed_scale),
    exl3=True,
    refusals={"mlx": "mlx-lm's Gemma 2 has no sliding window, so past the window its outputs differ"},
)
