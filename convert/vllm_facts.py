"""The vocabulary of an architecture's vLLM facts (an entry of ``convert.arch`` holds one ``VllmFacts``): where vLLM
0.32's model class reads a model's settings from elsewhere than transformers does, or hard-codes them. Each is a
function of ``config.json``; this module imports nothing of the package."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class VllmFacts:
    """What the exporter adds to a bundle, or refuses, so that vLLM computes what transformers does."""

    config_fix: Callable[[dict], dict] | None = None  # config.json keys vLLM needs (added beside the others)
    generation_fix: Callable[[dict], dict] | None = None  # generation_config.json keys vLLM reads settings from
    config_check: Callable[[dict], str | None] | None = None  # why vLLM would compute otherwise (None: it does not)


def llama_4_scaling(config: dict) -> dict:
    """vLLM 0.32 runs Ministral3ForCausalLM with its Mistral model, which applies Llama 4's attention temperature
    only from ``config.llama_4_scaling`` (Mistral's own params format) and ignores transformers'
    ``rope_parameters.llama_4_scaling_beta``: past the original context its logits would differ."""
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    beta = rp.get("llama_4_scaling_beta")
    if not beta or "llama_4_scaling" in config:
        return {}
    return {"llama_4_scaling": {"beta": beta, "original_max_position_embeddings":
                                rp.get("original_max_position_embeddings") or config["max_position_embeddings"]}}


def lfm2_dims(config: dict) -> dict:
    """vLLM 0.32's Lfm2ForCausalLM reads ``block_dim`` (the MLP's input) and ``conv_dim`` (the convolution's width),
    which transformers never writes: both the hidden size."""
    return {k: config["hidden_size"] for k in ("block_dim", "conv_dim") if k not in config}


def llama4_temperature(config: dict) -> dict:
    """vLLM 0.32's Llama 4 takes ``attn_temperature_tuning`` from generation_config.json alone and, without it there,
    turns the query temperature of the layers without RoPE on only when max_model_len > 32768; transformers applies it
    whenever config.json says so (from position 8191 on it changes the logits)."""
    return {"attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True))}


def gpt_oss_fixed(config: dict) -> str | None:
    """What vLLM 0.32's GptOssForCausalLM hard-codes instead of reading config.json: RMSNorm eps 1e-5, a sliding
    window on the even layers (layer_types unread), SwiGLU alpha 1.702 and limit 7.0."""
    eps = config.get("rms_norm_eps", 1e-5)
    types = config.get("layer_types")
    if eps != 1e-5:
        return f"vLLM's gpt-oss uses RMSNorm eps 1e-5 whatever config.json says (this model: {eps})"
    if types and list(types) != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]:
        return "vLLM's gpt-oss puts the sliding window on the even layers whatever layer_types says"
    if (config.get("swiglu_limit", 7.0), config.get("swiglu_alpha", 1.702)) != (7.0, 1.702):
        return "vLLM's gpt-oss hard-codes SwiGLU alpha 1.702 and limit 7.0"
    return None


def lfm2_fixed(config: dict) -> str | None:
    """vLLM 0.32's Lfm2ForCausalLM always ties the output projection to the embeddings and sizes its heads at
    hidden / heads."""
    if config.get("tie_word_embeddings", True) is False:
        return "vLLM's LFM2 always projects the output with the embeddings (this model has its own lm_head)"
    heads, head_dim = int(config["num_attention_heads"]), config.get("head_dim")
    if head_dim is not None and head_dim * heads != int(config["hidden_size"]):
        return f"vLLM's LFM2 sizes its heads at hidden_size / num_attention_heads, not head_dim {head_dim}"
    return None


def unclamped(limit) -> bool:
    """Granite 4's ``time_step_limit`` clamps nothing: (0, inf), as the file says it (``[0.0, Infinity]``, or
    transformers 5's ``{"__float__": "Infinity"}``) or leaves it to transformers' default."""
    if limit is None:
        return True
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        return False
    lo, hi = limit
    return lo in (0, 0.0) and (hi == math.inf or hi == {"__float__": "Infinity"})


def granite_hybrid_fixed(config: dict) -> str | None:
    """vLLM 0.32's GraniteMoeHybridForCausalLM never clamps the Mamba step size (its dt limit is (0, inf) whatever
    ``time_step_limit`` says) and normalizes the gated output per group; transformers clamps in its chunked scan and
    normalizes over the whole inner size."""
    if not unclamped(limit := config.get("time_step_limit")):
        return f"vLLM's Granite 4 never clamps the Mamba step size (this model clamps it to {limit})"
    if int(config.get("mamba_n_groups") or 1) != 1:
        return "vLLM's Granite 4 normalizes the Mamba output per group, transformers over the whole inner size"
    return None
