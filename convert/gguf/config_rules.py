"""The vocabulary of the GGUF config rules: what llama.cpp does with a ``config.json`` key (carried into the
GGUF's metadata, folded into the weights, capped, or refused with the reason; ``convert/config_audit.py``),
in sets the architectures' entries (``convert.arch.<model_type>``) compose.

Facts from llama.cpp's model loader (vendored in llama-cpp-python 0.3.36):
- the llama graph (which runs Mistral), qwen2/qwen3 and phi3 run no sliding window (phi3: a window of 8 or 9
  gave the same logits, measured): a window shorter than the
  context becomes the GGUF's ``context_length`` (outputs agree up to it; llama.cpp warns past it);
- Gemma 3 scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) at 62 layers, its 27B) and marks every
  6th layer global: ``query_pre_attn_scalar`` is folded into ``attn_q_norm`` (exact: the norm's output only
  goes through RoPE, a rotation, before the scale) and other layer patterns are refused;
- RoPE: default, linear and yarn are carried, llama3 (a ``rope_freqs`` tensor) for the llama graph only
  (qwen2 does not load the tensor), LongRoPE for phi3 (its factor tensors); dynamic NTK and the others are refused.
"""

from __future__ import annotations

from ..config_audit import KeyRule, must_be, yarn_untruncated

ROPE_TYPES = ("default", "linear", "yarn")  # llama3's rope_freqs tensor: only the llama graph loads it


def rope_check(*types: str):
    """RoPE settings llama.cpp is given for an architecture: these types, refused otherwise."""
    def check(value, cfg: dict) -> str | None:
        if not isinstance(value, dict):
            return None
        layers = [value[k] for k in ("full_attention", "sliding_attention") if isinstance(value.get(k), dict)]
        for p in layers or [value]:
            kind = p.get("rope_type", p.get("type", "default"))
            if kind not in types:
                return f"RoPE types llama.cpp runs for {cfg.get('model_type')}: {', '.join(types)}, not {kind!r}"
            if kind == "yarn" and p.get("truncate") is False:
                return YARN_UNTRUNCATED
        return None
    return check


# ggml_rope_yarn_corr_dims rounds YaRN's correction range to whole dimensions and no GGUF key changes that
YARN_UNTRUNCATED = yarn_untruncated("llama.cpp") + ", as in every gpt-oss GGUF"


def layer_pattern(key: str, want, rule: str):
    """A check that the per-layer list ``key`` follows the fixed pattern llama.cpp assumes (element i is
    ``want(i)``), which no GGUF key can change: ``rule`` says what llama.cpp does."""
    def check(value, cfg: dict) -> str | None:
        return None if list(value) == [want(i) for i in range(len(value))] else (
            f"{rule}; this model's {key} differ: {value}")
    return check


def gemma_rules(version: int, global_every: int) -> dict[str, KeyRule]:
    """What Gemma 2 and 3 share in llama.cpp: tanh-GELU (read from hidden_activation), a sliding window with every
    ``global_every``-th layer global, causal attention without biases."""
    name, nth = f"Gemma {version}", f"{global_every}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(global_every, 'th')}"
    return {
        "hidden_act": KeyRule("inert", f"{name} reads hidden_activation"),
        "hidden_activation": KeyRule("refused unless", "gelu_pytorch_tanh", must_be(
            "gelu_pytorch_tanh", why=f"llama.cpp's {name} graph uses tanh-GELU")),
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": KeyRule("refused unless", f"every {nth} layer global", layer_pattern(
            "layer_types", lambda i: "full_attention" if (i + 1) % global_every == 0 else "sliding_attention",
            f"llama.cpp makes every {nth} layer global (set_swa_pattern({global_every}))")),
        "use_bidirectional_attention": KeyRule("refused unless", "false", must_be(
            False, None, why=f"llama.cpp runs {name} causally")),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, why=f"llama.cpp's {name} graph has no attention biases")),
    }


def window_active(cfg: dict) -> bool:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        return False
    return bool(window) and int(window) < int(cfg.get("max_position_embeddings") or 0)


SHAPES = {k: KeyRule("carried", f"{k} from the tensors' shapes and the GGUF hyperparameters") for k in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim")}
COMMON: dict[str, KeyRule] = {
    **SHAPES,
    "rms_norm_eps": KeyRule("carried", "attention.layer_norm_rms_epsilon"),
    "max_position_embeddings": KeyRule("carried", "context_length"),
    "tie_word_embeddings": KeyRule("carried", "no output.weight when tied: llama.cpp reuses token_embd"),
    "rope_theta": KeyRule("carried", "rope.freq_base"),
    "rope_parameters": KeyRule("carried", "rope.freq_base and rope.scaling.* (linear, yarn)",
                               rope_check(*ROPE_TYPES)),
    "rope_scaling": KeyRule("carried", "as rope_parameters", rope_check(*ROPE_TYPES)),
    "hidden_act": KeyRule("refused unless", "silu (llama.cpp's SwiGLU)",
                          must_be("silu", why="llama.cpp's graph for it uses SiLU")),
    "quantization_config": KeyRule("inert", "quantized inputs are refused before the audit"),
    "pretraining_tp": KeyRule("inert", "transformers 5 computes the same for every value"),
}
def attention_layer_types(value, cfg: dict) -> str | None:
    """Layer types of full or sliding-window attention only (another kind of layer is refused, named)."""
    if all(t in ("full_attention", "sliding_attention") for t in value):
        return None
    return f"layer types {sorted(set(value))}"


NO_SLIDING_GRAPH = {
    "sliding_window": KeyRule("capped", "llama.cpp runs no sliding window here: a window shorter than the context "
                              "becomes context_length"),
    "use_sliding_window": KeyRule("capped", "as sliding_window"),
    "max_window_layers": KeyRule("inert", "with use_sliding_window the cap applies to every layer"),
    "layer_types": KeyRule("capped", "sliding layers equal full ones up to the capped context_length",
                           attention_layer_types),
}
BIASES = {
    "attention_bias": KeyRule("carried", "attn_{q,k,v,output}.bias"),
    "mlp_bias": KeyRule("carried", "ffn_{gate,up,down}.bias"),
}

LLAMA_ROPE = {
    "rope_parameters": KeyRule("carried", "rope.freq_base and rope.scaling.* (linear, yarn) or a rope_freqs tensor "
                               "(llama3)", rope_check(*ROPE_TYPES, "llama3")),
    "rope_scaling": KeyRule("carried", "as rope_parameters", rope_check(*ROPE_TYPES, "llama3")),
}

# what transformers' YaRN reads beside rope_parameters, for a graph that rotates the whole head
YARN_READS = {
    "partial_rotary_factor": KeyRule("refused unless", "1", must_be(1, 1.0, None, why="llama.cpp rotates the whole "
                                                                    "head (rope.dimension_count = head size)")),
    "original_max_position_embeddings": KeyRule("carried", "rope.scaling.original_context_length"),
    "default_rope_type": KeyRule("inert", "the config class's own default, not a config.json key"),
}

NO_BIASES = {k: KeyRule("refused unless", "false", must_be(False, None, why="llama.cpp's graph for it has no "
                                                              "such biases")) for k in ("attention_bias", "mlp_bias")}

MOE = {
    "num_local_experts": KeyRule("carried", "expert_count"),
    "num_experts": KeyRule("carried", "expert_count"),
    "num_experts_per_tok": KeyRule("carried", "expert_used_count"),
    "router_aux_loss_coef": KeyRule("inert", "a training loss"),
    "output_router_logits": KeyRule("inert", "returns the router's logits for that loss"),
    "router_jitter_noise": KeyRule("inert", "applied in training only"),
}
SHARED_EXPERT_RULES = {
    "moe_intermediate_size": KeyRule("carried", "expert_feed_forward_length"),
    "shared_expert_intermediate_size": KeyRule("carried", "expert_shared_feed_forward_length"),
}
