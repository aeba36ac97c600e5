"""What llama.cpp does with each ``config.json`` key, per architecture: carried into the GGUF's metadata,
folded into the weights, capped, or refused with the reason (the audit's rules; ``convert/config_audit.py``).

Facts from llama.cpp's model loader (vendored in llama-cpp-python 0.3.36):
- the llama graph (which runs Mistral), qwen2/qwen3 and phi3 run no sliding window (phi3: a window of 8 or 9
  gave the same logits, measured): a window shorter than the
  context becomes the GGUF's ``context_length`` (outputs agree up to it; llama.cpp warns past it);
- Gemma 3 scales queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) at 62 layers, its 27B) and marks every
  6th layer global: ``query_pre_attn_scalar`` is folded into ``attn_q_norm`` (exact: the norm's output only
  goes through RoPE, a rotation, before the scale) and other layer patterns are refused;
- RoPE: default, linear and yarn are carried, llama3 (a ``rope_freqs`` tensor) for the llama graph only
  (qwen2 does not load the tensor); dynamic NTK, longrope and the others are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config_audit import KeyRule, audit, effective_config, must_be

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
        return None
    return check


def _window_active(cfg: dict) -> bool:
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
NO_SLIDING_GRAPH = {
    "sliding_window": KeyRule("capped", "llama.cpp runs no sliding window here: a window shorter than the context "
                              "becomes context_length"),
    "use_sliding_window": KeyRule("capped", "as sliding_window"),
    "max_window_layers": KeyRule("inert", "with use_sliding_window the cap applies to every layer"),
    "layer_types": KeyRule("capped", "sliding layers equal full ones up to the capped context_length",
                           lambda v, cfg: None if all(t in ("full_attention", "sliding_attention") for t in v)
                           else f"layer types {sorted(set(v))}"),
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


def _gemma2_softcap(value, cfg: dict) -> str | None:
    return None if value else "llama.cpp always soft-caps Gemma 2's logits (50 and 30 when the GGUF gives none)"


def _gemma3_layers(value, cfg: dict) -> str | None:
    want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(len(value))]
    return None if list(value) == want else ("llama.cpp makes every 6th layer global (set_swa_pattern(6)); "
                                             f"this model's layer_types differ: {value}")


GGUF_CONFIG_RULES: dict[str, dict[str, KeyRule]] = {
    "llama": {**COMMON, **NO_SLIDING_GRAPH, **BIASES, **LLAMA_ROPE},
    "mistral": {**COMMON, **NO_SLIDING_GRAPH, **LLAMA_ROPE},
    "qwen2": {**COMMON, **NO_SLIDING_GRAPH},
    "qwen3": {**COMMON, **NO_SLIDING_GRAPH, "attention_bias": BIASES["attention_bias"]},
    "gemma3_text": {
        **COMMON,
        "hidden_act": KeyRule("inert", "Gemma 3 reads hidden_activation"),
        "hidden_activation": KeyRule("refused unless", "gelu_pytorch_tanh", must_be(
            "gelu_pytorch_tanh", why="llama.cpp's Gemma 3 graph uses tanh-GELU")),
        "query_pre_attn_scalar": KeyRule("folded", "attn_q_norm multiplied by sqrt(d / query_pre_attn_scalar), "
                                         "d the size llama.cpp scales queries by"),
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": KeyRule("refused unless", "every 6th layer global", _gemma3_layers),
        "_sliding_window_pattern": KeyRule("inert", "layer_types is what counts"),
        # transformers 4's layout of the same settings
        "sliding_window_pattern": KeyRule("refused unless", "6", must_be(
            6, why="llama.cpp makes every 6th layer global (set_swa_pattern(6))")),
        "rope_local_base_freq": KeyRule("carried", "rope.freq_base_swa"),
        "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping"),
        "attn_logit_softcapping": KeyRule("refused unless", "none", must_be(
            None, why="llama.cpp's Gemma 3 graph does not soft-cap attention logits")),
        "use_bidirectional_attention": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp runs Gemma 3 causally")),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, why="llama.cpp's Gemma 3 graph has no attention biases")),
    },
    "gemma2": {
        **COMMON,
        "hidden_act": KeyRule("inert", "Gemma 2 reads hidden_activation"),
        "tie_word_embeddings": KeyRule("refused unless", "true", must_be(
            True, why="llama.cpp's Gemma 2 has no output tensor: it reuses token_embd")),
        "hidden_activation": KeyRule("refused unless", "gelu_pytorch_tanh", must_be(
            "gelu_pytorch_tanh", why="llama.cpp's Gemma 2 graph uses tanh-GELU")),
        "query_pre_attn_scalar": KeyRule("folded", "attn_q rows (and a q_proj LoRA's B) multiplied by "
                                         "sqrt(d / query_pre_attn_scalar): Gemma 2 has no q norm"),
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": KeyRule("refused unless", "every 2nd layer global", lambda v, cfg: None if list(v) == [
            "full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(len(v))] else
            f"llama.cpp makes every 2nd layer global (set_swa_pattern(2)); this model's layer_types differ: {v}"),
        "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping", _gemma2_softcap),
        "attn_logit_softcapping": KeyRule("carried", "attn_logit_softcapping", _gemma2_softcap),
        "use_bidirectional_attention": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp runs Gemma 2 causally")),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, why="llama.cpp's Gemma 2 graph has no attention biases")),
    },
    "phi3": {
        **COMMON,
        "sliding_window": NO_SLIDING_GRAPH["sliding_window"],  # measured: llama.cpp's phi3 attends to all
        "original_max_position_embeddings": KeyRule("inert", "used only by longrope, which is refused"),
        "partial_rotary_factor": KeyRule("carried", "rope.dimension_count"),
    },
}

NO_BIASES = {k: KeyRule("refused unless", "false", must_be(False, None, why="llama.cpp's graph for it has no "
                                                              "such biases")) for k in ("attention_bias", "mlp_bias")}


def _smollm3_no_rope(value, cfg: dict) -> str | None:
    want = [int((i + 1) % 4 != 0) for i in range(len(value))]
    return None if list(value) == want else ("llama.cpp skips RoPE on every 4th layer (n_no_rope_layer_step 4, "
                                             f"no GGUF key); this model's no_rope_layers differ: {value}")


GGUF_CONFIG_RULES["olmo2"] = {**COMMON, "attention_bias": NO_BIASES["attention_bias"]}
GGUF_CONFIG_RULES["granite"] = {
    **COMMON, **NO_BIASES,
    "embedding_multiplier": KeyRule("carried", "embedding_scale"),
    "residual_multiplier": KeyRule("carried", "residual_scale"),
    "attention_multiplier": KeyRule("carried", "attention.scale"),
    "logits_scaling": KeyRule("carried", "logit_scale"),
}
GGUF_CONFIG_RULES["smollm3"] = {
    **COMMON, **NO_SLIDING_GRAPH, **NO_BIASES,
    "no_rope_layers": KeyRule("refused unless", "every 4th layer without RoPE", _smollm3_no_rope),
    "no_rope_layer_interval": KeyRule("refused unless", "4", must_be(
        4, why="llama.cpp skips RoPE on every 4th layer (n_no_rope_layer_step 4, no GGUF key)")),
}

MOE = {
    "num_local_experts": KeyRule("carried", "expert_count"),
    "num_experts": KeyRule("carried", "expert_count"),
    "num_experts_per_tok": KeyRule("carried", "expert_used_count"),
    "router_aux_loss_coef": KeyRule("inert", "a training loss"),
    "output_router_logits": KeyRule("inert", "returns the router's logits for that loss"),
    "router_jitter_noise": KeyRule("inert", "applied in training only"),
}
GGUF_CONFIG_RULES["mixtral"] = {**COMMON, **NO_SLIDING_GRAPH, **{k: v for k, v in MOE.items() if k != "num_experts"}}
GGUF_CONFIG_RULES["qwen3_moe"] = {
    **COMMON, **NO_SLIDING_GRAPH, **MOE,
    "attention_bias": BIASES["attention_bias"],
    "moe_intermediate_size": KeyRule("carried", "expert_feed_forward_length"),
    "norm_topk_prob": KeyRule("refused unless", "true", must_be(
        True, why="llama.cpp's Qwen3-MoE graph renormalizes the chosen experts' weights")),
    "decoder_sparse_step": KeyRule("refused unless", "1", must_be(
        1, why="llama.cpp makes every Qwen3-MoE layer sparse")),
    "mlp_only_layers": KeyRule("refused unless", "none", must_be(
        [], None, why="llama.cpp makes every Qwen3-MoE layer sparse")),
}


@dataclass
class GGUFConfigFacts:
    """What the audit decided for one export: metadata overrides, weight folds and notes for the manifest."""

    context_length: int | None = None
    q_norm_factor: float | None = None  # Gemma 3: the query scale folded into attn_q_norm
    q_proj_factor: float | None = None  # Gemma 2 (no q norm): into attn_q's rows and q_proj LoRA B
    notes: list[str] = field(default_factory=list)


# Gemma: the layer count at which llama.cpp takes the model for its 27B and scales queries by
# 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim); and where the query scale is folded.
GEMMA_27B_LAYERS = {"gemma3_text": 62, "gemma2": 46}
QUERY_FOLD = {"gemma3_text": "q_norm", "gemma2": "q_proj"}


def gemma_attention_scale_dim(model_type: str, cfg: dict) -> float:
    """The d of llama.cpp's 1/sqrt(d) query scale for Gemma 2 and 3."""
    if int(cfg["num_hidden_layers"]) == GEMMA_27B_LAYERS[model_type]:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return float(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def gguf_config_facts(model_type: str, cfg: dict) -> GGUFConfigFacts:
    """Audit ``cfg`` for GGUF (UserError on a value llama.cpp cannot honour) and derive what to write."""
    rules = GGUF_CONFIG_RULES.get(model_type)
    if rules is None:
        return GGUFConfigFacts()
    found = audit(cfg, rules, "gguf", unhandled="tuneport's GGUF writer does not carry it into llama.cpp")
    cfg = effective_config(cfg)
    facts = GGUFConfigFacts(notes=found.notes(model_type))
    if rules.get("sliding_window") is NO_SLIDING_GRAPH["sliding_window"] and _window_active(cfg):
        facts.context_length = int(cfg["sliding_window"])
        facts.notes.append(f"context_length {facts.context_length}: the model's sliding window, which llama.cpp "
                           f"does not run for {model_type} (max_position_embeddings "
                           f"{cfg.get('max_position_embeddings')})")
    if (rule := rules.get("query_pre_attn_scalar")) is not None and rule.how == "folded":
        scalar = cfg.get("query_pre_attn_scalar")
        d = gemma_attention_scale_dim(model_type, cfg)
        if scalar and not math.isclose(float(scalar), d):
            factor, into = math.sqrt(d / float(scalar)), QUERY_FOLD[model_type]
            setattr(facts, f"{into}_factor", factor)
            facts.notes.append(f"query_pre_attn_scalar {scalar} folded into {into} (x{factor:.6g}): "
                               f"llama.cpp scales queries by 1/sqrt({d:g})")
    return facts
