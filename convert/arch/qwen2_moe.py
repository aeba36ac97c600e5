"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): a router and per-expert gate/up/down projections beside one
shared expert, whose output a sigmoid gate (``shared_expert_gate``, a [1, hidden] linear) scales; q/k/v biased."""

from ..calibration.layouts import ATTENTION_GROUPS, ScaleGroup, transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, SHARED_EXPERTS, GGUFArch
from ..gguf.config_rules import COMMON, MOE, NO_SLIDING_GRAPH, SHARED_EXPERT_RULES
from ..mlx.arch_facts import MlxArch, no_sliding_window, rope_top_level
from .spec import ATTENTION_LINEARS, ArchSpec, ExpertLayout

SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
ALL_SPARSE = "llama.cpp makes every Qwen2-MoE layer sparse"

ARCH = ArchSpec(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    gguf_arch="qwen2moe",
    rope_style="neox",
    linear_modules=ATTENTION_LINEARS + SHARED,  # the routed experts' projections are per expert (ExpertLayout)
    vllm_lora_modules=ATTENTION_LINEARS,
    experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    notes=("mixture of experts with a shared expert: a router and per-expert gate/up/down projections, plus "
           "mlp.shared_expert (a dense MLP every token runs) scaled by sigmoid(mlp.shared_expert_gate); q/k/v biased",),
    # llama.cpp's Qwen2MoeModel converter and src/models/qwen2moe.cpp: shared expert as ffn_*_shexp, its gate as
    # ffn_gate_inp_shexp (kept F32, as the converter keeps it), experts' weights not renormalized (norm_w false)
    gguf=GGUFArch(COMMON_HPARAMS + EXPERTS + SHARED_EXPERTS, {
        **COMMON, **NO_SLIDING_GRAPH, **MOE,
        "qkv_bias": KeyRule("carried", "attn_{q,k,v}.bias (optional in llama.cpp's Qwen2-MoE)"),
        **SHARED_EXPERT_RULES,
        "norm_topk_prob": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp's Qwen2-MoE graph does not renormalize the chosen experts' weights")),
        "decoder_sparse_step": KeyRule("refused unless", "1", must_be(1, why=ALL_SPARSE)),
        "mlp_only_layers": KeyRule("refused unless", "none", must_be([], None, why=ALL_SPARSE)),
        "tie_word_embeddings": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp's Qwen2-MoE loads its own output tensor, never token_embd")),
    }, keep_f32=("ffn_gate_inp_shexp.weight",)),
    # mlx_lm.models.qwen2_moe: experts stacked into switch_mlp (sanitize), no quant_predicate (the router and the
    # shared expert's gate quantized like any linear); it does not read norm_topk_prob (the audit refuses true)
    mlx=MlxArch("qwen2_moe", (rope_top_level, no_sliding_window),
                switch_mlp=(("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                notes=("experts stacked into switch_mlp, as mlx-lm keeps them",)),
    # the norm before the router feeds the shared expert and its gate too: they take the experts' scale
    awq=transformers_layout(
        "qwen2_moe", "Qwen2Moe",
        (*ATTENTION_GROUPS,
         # the shared expert's gate/up and its sigmoid gate take the experts' scale (moe_shared), not one of their own
         # (the gate, one output row, stays 16-bit: vLLM builds it unquantized)
         ScaleGroup(None, "none", (*SHARED[:2], "mlp.shared_expert_gate")),
         ScaleGroup("mlp.shared_expert.up_proj", "linear", ("mlp.shared_expert.down_proj",))),
        moe_norm="post_attention_layernorm",
        moe_shared=(*SHARED[:2], "mlp.shared_expert_gate"),
        sparse_layers=(("mlp_only_layers", []), ("decoder_sparse_step", 1))),
    refusals={"exl3": "exllamav3 has no architecture for Qwen2MoeForCausalLM"},
)
