"""Qwen3-MoE: a router and per-expert gate/up/down projections, per-head q/k norms."""

from ..calibration.layouts import ATTENTION_GROUPS, transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, GGUFArch
from ..gguf.config_rules import BIASES, COMMON, MOE, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch, expert_count_key, no_sliding_window, rope_top_level
from .spec import ATTENTION_LINEARS, ArchSpec, ExpertLayout

ARCH = ArchSpec(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    gguf_arch="qwen3moe",
    rope_style="neox",
    linear_modules=ATTENTION_LINEARS,  # the experts' projections are per expert (ExpertLayout)
    vllm_lora_modules=ATTENTION_LINEARS,
    experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    notes=("mixture of experts: a router and per-expert gate/up/down projections; per-head q_norm / k_norm",),
    gguf=GGUFArch(COMMON_HPARAMS + EXPERTS + (("expert_feed_forward_length", ("moe_intermediate_size",), "u32"),), {
        **COMMON, **NO_SLIDING_GRAPH, **MOE,
        "attention_bias": BIASES["attention_bias"],
        "moe_intermediate_size": KeyRule("carried", "expert_feed_forward_length"),
        "norm_topk_prob": KeyRule("refused unless", "true", must_be(
            True, why="llama.cpp's Qwen3-MoE graph renormalizes the chosen experts' weights")),
        "decoder_sparse_step": KeyRule("refused unless", "1", must_be(
            1, why="llama.cpp makes every Qwen3-MoE layer sparse")),
        "mlp_only_layers": KeyRule("refused unless", "none", must_be(
            [], None, why="llama.cpp makes every Qwen3-MoE layer sparse")),
    }),
    # mlx_lm.models.qwen3_moe.Model.quant_predicate: the router at 8 bits
    mlx=MlxArch("qwen3_moe", (rope_top_level, no_sliding_window, expert_count_key),
                switch_mlp=(("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                quant_predicate=lambda path: {"group_size": 64, "bits": 8} if path.endswith("mlp.gate") else None,
                notes=("experts stacked into switch_mlp, as mlx-lm keeps them",)),
    awq=transformers_layout("qwen3_moe", "Qwen3Moe", ATTENTION_GROUPS, moe_norm="post_attention_layernorm",
                            sparse_layers=(("mlp_only_layers", []), ("decoder_sparse_step", 1))),
    exl3=True,
)
