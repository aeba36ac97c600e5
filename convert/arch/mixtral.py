"""Mixtral: a router and per-expert w1/w3/w2 under block_sparse_moe on disk."""

from ..calibration.layouts import ATTENTION_GROUPS, transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, GGUFArch
from ..gguf.config_rules import COMMON, MOE, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch, no_sliding_window, rope_top_level
from .spec import ATTENTION_LINEARS, ArchSpec, ExpertLayout

ARCH = ArchSpec(
    "mixtral",
    ("MixtralForCausalLM",),
    gguf_arch="llama",
    rope_style="normal",
    linear_modules=ATTENTION_LINEARS,  # the experts' projections are per expert (ExpertLayout)
    vllm_lora_modules=ATTENTION_LINEARS,
    experts=ExpertLayout("block_sparse_moe", "w1", "w3", "w2"),
    notes=("mixture of experts: a router and per-expert w1/w3/w2 under block_sparse_moe on disk (transformers 5 "
           "fuses them into mlp.experts in memory)",),
    gguf=GGUFArch(COMMON_HPARAMS + EXPERTS, {**COMMON, **NO_SLIDING_GRAPH,
                                             **{k: v for k, v in MOE.items() if k != "num_experts"}},
                  write_vocab_size=True, write_rope_dims=True),
    mlx=MlxArch("mixtral", (rope_top_level, no_sliding_window),
                switch_mlp=(("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")),
                notes=("experts stacked into switch_mlp, as mlx-lm keeps them",)),
    awq=transformers_layout("mixtral", "Mixtral", ATTENTION_GROUPS, moe_norm="post_attention_layernorm"),
    exl3=True,
)
