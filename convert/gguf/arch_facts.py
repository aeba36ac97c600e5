"""The vocabulary of an architecture's GGUF facts (from llama.cpp's own converter and loader): which config
keys become which GGUF hyperparameters, what the writer folds into the weights, and the audit's rules. An
architecture's entry (``convert.arch.<model_type>``) holds one ``GGUFArch``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..config_audit import KeyRule

if TYPE_CHECKING:
    import torch

# (GGUF key suffix, HF config keys tried in order, kind): written when a key is present
HParam = tuple[str, tuple[str, ...], str]


@dataclass(frozen=True, eq=False)
class GGUFArch:
    """How one HF architecture becomes GGUF."""

    hparams: tuple[HParam, ...]
    # what llama.cpp does with each config.json key (``gguf.config_rules``'s vocabulary); a key it leaves out is
    # judged by what transformers reads (``config_audit``)
    config_rules: Mapping[str, KeyRule] = field(default_factory=lambda: MappingProxyType({}))
    norm_offset: float = 0.0  # Gemma stores norm weights as (w - 1)
    norm_offset_skip: tuple[str, ...] = ()  # norms (name suffixes) stored as they multiply (Qwen3.5's gated norm)
    write_vocab_size: bool = False
    write_rope_dims: bool = False
    write_freq_base_swa: bool = False  # sliding-window layers have their own RoPE base (Gemma 3)
    write_swa_pattern: bool = False  # one sliding-window flag per layer, from layer_types (OLMo 3)
    # (GGUF key suffix, key of the full-attention RoPE parameters, kind): written when present (Ministral 3's YaRN
    # betas and attention temperature live in rope_parameters)
    rope_hparams: tuple[HParam, ...] = ()
    # LongRoPE (Phi-3.5 / Phi-4-mini): rope_factors_short / _long tensors and the attention factor; llama.cpp takes
    # the short factors while its context is at most original_max_position_embeddings
    longrope: bool = False
    sliding_window_default: int | None = None  # written when the config has none (phi3: 0 = off)
    softcap: bool = False  # final_logit_softcapping
    attn_softcap: bool = False  # attn_logit_softcapping (Gemma 2)
    # Gemma: where ``query_pre_attn_scalar`` is folded ("q_norm" or "q_proj"), and the layer count at which
    # llama.cpp takes the model for its 27B and scales queries by 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim)
    query_fold: str | None = None
    hidden_scaled_queries_at_layers: int | None = None
    # tensors (GGUF name suffixes) kept in F32 besides the norms and the router
    keep_f32: tuple[str, ...] = ()
    # Gated DeltaNet layers (Qwen3.5): their tensors' renames and reorders, ssm.* hyperparameters
    # (``gguf.linear_attention``)
    delta_net: bool = False
    # Mamba-2 layers (Granite 4's hybrid): their tensors' renames and layouts, ssm.* hyperparameters (``gguf.mamba2``)
    mamba2: bool = False
    # config -> (another entry's model_type, the config as that entry reads it) where llama.cpp runs this config as
    # that architecture (its converter's own choice: a Granite 4 without Mamba layers is a Granite 3 model), else None
    devolve: Callable[[dict], tuple[str, dict] | None] | None = None
    dropped_prefixes: tuple[str, ...] = ()  # checkpoint tensors llama.cpp's graph does not load (an MTP head)
    # bare parameters (GGUF names without a suffix) llama.cpp loads as ``<name>.weight`` (gpt-oss's ``attn_sinks``)
    weight_suffixed: tuple[str, ...] = ()
    # checkpoint tensors (name suffixes) stored with a unit middle dimension llama.cpp drops (LFM2's depthwise conv
    # [H, 1, L] -> [H, L]), as its converter squeezes them
    squeezed: tuple[str, ...] = ()
    # hyperparameters derived from the config rather than copied from one key: config -> {GGUF key suffix: value}
    # (a bool is written as one, an int u32, a float f32, a list of ints an array of them)
    derived_hparams: Callable[[dict], dict[str, object]] | None = None
    # GGUF tensors llama.cpp applies no LoRA to (its graph does not go through build_lora_mm): (suffix, why)
    no_lora: tuple[tuple[str, str], ...] = ()
    # config -> the ``rope_freqs`` tensor (frequency divisors) the graph always loads (Gemma 4's proportional RoPE:
    # 1e30 on the pairs it leaves still); its full-attention RoPE type is then not otherwise written
    rope_freqs: Callable[[dict], torch.Tensor] | None = None


COMMON_HPARAMS: tuple[HParam, ...] = (
    ("context_length", ("max_position_embeddings", "n_ctx", "n_positions"), "u32"),
    ("embedding_length", ("hidden_size", "n_embd"), "u32"),
    ("feed_forward_length", ("intermediate_size", "n_inner"), "u32"),
    ("attention.head_count", ("num_attention_heads", "n_head"), "u32"),
    ("attention.head_count_kv", ("num_key_value_heads", "n_kv_heads", "num_attention_heads"), "u32"),
    ("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), "f32"),
    ("attention.key_length", ("head_dim",), "u32"),
    ("attention.value_length", ("head_dim",), "u32"),
)
SLIDING: tuple[HParam, ...] = (("attention.sliding_window", ("sliding_window",), "u32"),)
EXPERTS: tuple[HParam, ...] = (("expert_count", ("num_local_experts", "num_experts"), "u32"),
                               ("expert_used_count", ("num_experts_per_tok",), "u32"))
# a routed mixture of experts beside a shared expert (Qwen2-MoE, Qwen3.5-MoE)
SHARED_EXPERTS: tuple[HParam, ...] = (
    ("expert_feed_forward_length", ("moe_intermediate_size",), "u32"),
    ("expert_shared_feed_forward_length", ("shared_expert_intermediate_size",), "u32"),
)
