"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj."""

from ..calibration.layouts import ScaleGroup, transformers_layout
from ..config_audit import KeyRule
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, NO_SLIDING_GRAPH, ROPE_TYPES, rope_check
from ..mlx.arch_facts import MlxArch, no_sliding_window, rope_top_level
from .spec import ArchSpec

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _v_rows(cfg) -> slice:
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    return slice(q + kv, q + 2 * kv)


# q/k/v and gate/up fused on disk: one linear each; o and down read rows of them
PHI3_GROUPS = (
    ScaleGroup("input_layernorm", "norm", ("self_attn.qkv_proj",)),
    ScaleGroup("self_attn.qkv_proj", "linear", ("self_attn.o_proj",), prev_rows=_v_rows),
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_up_proj",)),
    ScaleGroup("mlp.gate_up_proj", "linear", ("mlp.down_proj",),
               prev_rows=lambda cfg: slice(cfg.intermediate_size, 2 * cfg.intermediate_size)),
)

ARCH = ArchSpec(
    "phi3",
    ("Phi3ForCausalLM",),
    gguf_arch="phi3",
    rope_style="neox",
    linear_modules=FUSED,
    vllm_lora_modules=FUSED,
    notes=("fused qkv_proj and gate_up_proj",),
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING, {
        **COMMON,
        "sliding_window": NO_SLIDING_GRAPH["sliding_window"],  # measured: llama.cpp's phi3 attends to all
        "rope_parameters": KeyRule("carried", "rope.freq_base and rope.scaling.* (linear, yarn), or LongRoPE's "
                                   "rope_factors_short / _long and attn_factor", rope_check(*ROPE_TYPES, "longrope")),
        "rope_scaling": KeyRule("carried", "as rope_parameters", rope_check(*ROPE_TYPES, "longrope")),
        "original_max_position_embeddings": KeyRule(
            "carried", "rope.scaling.original_context_length: llama.cpp rotates with LongRoPE's short factors while "
            "its context is at most this long, transformers while the sequence is (equal for n_ctx <= it)"),
        "partial_rotary_factor": KeyRule("carried", "rope.dimension_count"),
    }, write_rope_dims=True, sliding_window_default=0, longrope=True),
    mlx=MlxArch("phi3", (rope_top_level, no_sliding_window)),
    awq=transformers_layout("phi3", "Phi3", PHI3_GROUPS, no_clip=("self_attn.qkv_proj",)),
    exl3=True,
)
