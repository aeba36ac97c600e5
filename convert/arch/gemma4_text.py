"""Gemma 4's text model (E2B / E4B, 31B, and the text tower of the released multimodal checkpoints): sliding-window
layers and full-attention layers with their own head size (``global_head_dim``) and "proportional" RoPE on part of
it; q, k and v normalized per head (v without a weight) and attention unscaled; per-layer embeddings (PLE) fed into
every layer; the last ``num_kv_shared_layers`` layers reusing the KV of the last earlier layer of their kind (and, with
``use_double_wide_mlp``, twice as wide an MLP); ``attention_k_eq_v``: full layers whose values are their keys; a
learned scalar on each layer's output; soft-capped logits. Norms multiply by their weight as stored (not 1 + w).

transformers 5.19 saves the full layers' head size and KV heads as ``per_layer_config`` (one entry per full layer)
where the hub's configs say ``global_head_dim`` / ``num_global_key_value_heads``; both are read."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import TYPE_CHECKING

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import GGUFArch
from ..gguf.config_rules import COMMON, attention_layer_types
from ..mlx.arch_facts import MlxArch
from .spec import LLAMA_LINEARS, ArchSpec

if TYPE_CHECKING:
    import torch

FULL, SLIDING = "full_attention", "sliding_attention"
LINEARS = (*LLAMA_LINEARS, "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection")


def layer_types(cfg: dict) -> list[str]:
    """transformers' default when the config has none: every 6th layer full, and the last one always."""
    n = int(cfg["num_hidden_layers"])
    kinds = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    kinds[-1] = FULL
    return kinds


def _full_layer_config(cfg: dict) -> dict:
    """A full layer's entry of transformers 5.19's ``per_layer_config`` (empty for a hub config)."""
    per_layer = cfg.get("per_layer_config") or {}
    full = [i for i, t in enumerate(layer_types(cfg)) if t == FULL]
    return dict(per_layer.get(str(full[0])) or per_layer.get(full[0]) or {}) if full else {}


def head_dims(cfg: dict) -> tuple[int, int]:
    """(sliding layers', full layers') head size."""
    full = _full_layer_config(cfg).get("head_dim") or cfg.get("global_head_dim") or 512
    return int(cfg.get("head_dim") or 256), int(full)


def kv_heads(cfg: dict) -> tuple[int, int]:
    """(sliding layers', full layers') KV heads: ``num_global_key_value_heads`` counts only with k_eq_v."""
    sliding = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    full = _full_layer_config(cfg).get("num_key_value_heads")
    if full is None and cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
        full = cfg["num_global_key_value_heads"]
    return sliding, int(full or sliding)


def shared_from(cfg: dict) -> int:
    """The first layer that reuses an earlier layer's KV (the layer count when none does)."""
    return int(cfg["num_hidden_layers"]) - int(cfg.get("num_kv_shared_layers") or 0)


def mlp_widths(cfg: dict) -> list[int]:
    width, first = int(cfg["intermediate_size"]), shared_from(cfg)
    double = bool(cfg.get("use_double_wide_mlp")) and first < int(cfg["num_hidden_layers"])
    return [2 * width if double and i >= first else width for i in range(int(cfg["num_hidden_layers"]))]


def _gguf_hparams(cfg: dict) -> dict[str, object]:
    """llama.cpp's gemma4 loader: per-layer MLP widths and KV heads, both head sizes (rotated whole, the full layers'
    partial rotation through rope_freqs), the shared-KV count, the PLE width (required, 0 for none) and the soft-cap
    (its default is 30, so 0 is written for none)."""
    (hd, full_hd), (kv, full_kv) = head_dims(cfg), kv_heads(cfg)
    kinds = layer_types(cfg)
    return {"feed_forward_length": mlp_widths(cfg),
            "attention.head_count_kv": [full_kv if t == FULL else kv for t in kinds],
            "attention.key_length": full_hd, "attention.value_length": full_hd,
            "attention.key_length_swa": hd, "attention.value_length_swa": hd,
            "rope.dimension_count": full_hd, "rope.dimension_count_swa": hd,
            "attention.shared_kv_layers": int(cfg.get("num_kv_shared_layers") or 0),
            "embedding_length_per_layer_input": int(cfg.get("hidden_size_per_layer_input") or 0),
            "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0)}


def _full_rope(cfg: dict) -> dict:
    rp = cfg.get("rope_parameters") or {}
    return dict(rp.get(FULL) or {}) if isinstance(rp, dict) else {}


def rope_freqs(cfg: dict) -> torch.Tensor:
    """The full layers' frequency divisors (llama.cpp's rope_freqs): proportional RoPE turns the first
    ``partial_rotary_factor · G / 2`` pairs at ``θ^(-2i/G) / factor`` and leaves the others still (1e30 there);
    default RoPE turns every pair."""
    import torch

    _, full_hd = head_dims(cfg)
    rp = _full_rope(cfg)
    if rp.get("rope_type", "default") == "default":
        return torch.ones(full_hd // 2)
    turned = int(float(rp.get("partial_rotary_factor", 1.0)) * full_hd // 2)
    factors = torch.full((full_hd // 2,), 1e30)
    factors[:turned] = float(rp.get("factor", 1.0))
    return factors


def vllm_value_lora(cfg: dict, modules: Collection[str]) -> dict[str, str]:
    """The full layers of a k_eq_v model take their values from k_proj (its LoRA included); vLLM loads k_proj into
    both its key and value shards but applies a k_proj LoRA to the keys only: v_proj gets the same LoRA."""
    if not cfg.get("attention_k_eq_v"):
        return {}
    kinds, first = layer_types(cfg), shared_from(cfg)
    copies = {}
    for module in modules:
        if (m := re.fullmatch(r"(.*\.layers\.(\d+)\.self_attn\.)k_proj", module)) is not None:
            if int(m[2]) < first and kinds[int(m[2])] == FULL:
                copies[m[1] + "v_proj"] = module
    return copies


def _rope(value, cfg: dict) -> str | None:
    if not isinstance(value, dict) or not (FULL in value or SLIDING in value):
        return "RoPE settings per layer kind (full_attention, sliding_attention) expected"
    sliding = (value.get(SLIDING) or {}).get("rope_type", "default")
    full = (value.get(FULL) or {}).get("rope_type", "default")
    if sliding != "default":
        return f"llama.cpp turns Gemma 4's sliding layers with default RoPE, not {sliding!r}"
    if full not in ("default", "proportional"):
        return f"llama.cpp's Gemma 4 graph runs default or proportional RoPE on its full layers, not {full!r}"
    return None


def _kv_sharing(value, cfg: dict) -> str | None:
    """llama.cpp's shared layers read the KV of layer first - 1 (full) or first - 2 (sliding); transformers' the
    last earlier layer of their kind: the same only when the two layers before the shared ones are sliding, full."""
    if not value:
        return None
    first, kinds = shared_from(cfg), layer_types(cfg)
    if first >= 2 and kinds[first - 1] == FULL and kinds[first - 2] == SLIDING:
        return None
    return ("llama.cpp's KV-shared layers reuse the KV of the two layers just before them (the last a full layer, "
            f"the one before it sliding); this model's layers {first - 2} and {first - 1} are "
            f"{kinds[max(first - 2, 0)]} and {kinds[first - 1]}")


def _layer_kinds(value, cfg: dict) -> str | None:
    if (why := attention_layer_types(value, cfg)) is not None:
        return why
    return None if SLIDING in value else "llama.cpp's Gemma 4 graph needs at least one sliding-window layer"


def _ple_vocab(value, cfg: dict) -> str | None:
    if not cfg.get("hidden_size_per_layer_input") or value == cfg.get("vocab_size"):
        return None
    return "llama.cpp looks per-layer embeddings up by token id in a table of vocab_size rows"


def mlx_config(cfg: dict) -> list[str]:
    """mlx-lm's gemma4_text reads ``global_head_dim`` / ``num_global_key_value_heads`` (transformers 5.19 saves
    ``per_layer_config`` instead) and defaults the E2B's shape for the keys a config leaves out (20 shared layers,
    PLE 256, double-wide MLPs, soft-cap 30): every one written as transformers computes it."""
    (_, full_hd), (_, full_kv) = head_dims(cfg), kv_heads(cfg)
    want = {"global_head_dim": full_hd, "layer_types": layer_types(cfg),
            "num_kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
            "hidden_size_per_layer_input": int(cfg.get("hidden_size_per_layer_input") or 0),
            "use_double_wide_mlp": bool(cfg.get("use_double_wide_mlp")),
            "attention_k_eq_v": bool(cfg.get("attention_k_eq_v")),
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "num_global_key_value_heads": full_kv if cfg.get("attention_k_eq_v") else None}
    filled = sorted(k for k, v in want.items() if cfg.get(k, "absent") != v)
    cfg.update(want)
    return filled


def hard_coded_rules(engine: str, moe: str) -> dict[str, KeyRule]:
    """What ``engine``'s Gemma 4 text model fixes that transformers reads (tanh-GELU, no attention biases, causal
    text), the top-level rope_theta nothing reads, and the mixture of experts tuneport does not write yet (``moe``:
    what is missing)."""
    return {
        "hidden_activation": KeyRule("refused unless", "gelu_pytorch_tanh", must_be(
            "gelu_pytorch_tanh", why=f"{engine} uses tanh-GELU")),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, None, why=f"{engine} has no attention biases")),
        "use_bidirectional_attention": KeyRule("refused unless", "none or vision", must_be(
            None, "vision", why=f"{engine} runs Gemma 4's text causally")),
        "rope_theta": KeyRule("inert", "Gemma 4 reads rope_parameters per layer kind"),
        "enable_moe_block": KeyRule("refused unless", "false", must_be(
            False, None, why=f"not built yet: tuneport does not {moe} (26B-A4B)")),
    }


MLX_RULES: dict[str, KeyRule] = {
    **hard_coded_rules("mlx-lm's gemma4_text", "stack Gemma 4's experts for mlx-lm"),
    "per_layer_config": KeyRule("carried", "as global_head_dim and num_global_key_value_heads"),
}


GEMMA4_GGUF_RULES: dict[str, KeyRule] = {
    **COMMON,
    "head_dim": KeyRule("carried", "attention.key_length_swa"),
    "global_head_dim": KeyRule("carried", "attention.key_length (the full layers' head size)"),
    "num_global_key_value_heads": KeyRule("carried", "attention.head_count_kv of the full layers (with k_eq_v)"),
    "per_layer_config": KeyRule("carried", "the full layers' head size and KV heads (transformers 5.19's layout)"),
    "hidden_act": KeyRule("inert", "Gemma 4 reads hidden_activation"),
    **hard_coded_rules("llama.cpp's Gemma 4 graph", "write Gemma 4's mixture-of-experts block"),
    "sliding_window": KeyRule("carried", "attention.sliding_window"),
    "layer_types": KeyRule("carried", "attention.sliding_window_pattern (one flag per layer)", _layer_kinds),
    "rope_parameters": KeyRule("carried", "rope.freq_base (full), rope.freq_base_swa, the rope_freqs tensor", _rope),
    "final_logit_softcapping": KeyRule("carried", "final_logit_softcapping (0 for none)"),
    "num_kv_shared_layers": KeyRule("carried", "attention.shared_kv_layers", _kv_sharing),
    "use_double_wide_mlp": KeyRule("carried", "feed_forward_length per layer"),
    "hidden_size_per_layer_input": KeyRule("carried", "embedding_length_per_layer_input"),
    "vocab_size_per_layer_input": KeyRule("carried", "per_layer_token_embd's rows", _ple_vocab),
    "attention_k_eq_v": KeyRule("carried", "no attn_v on the full layers: llama.cpp takes their keys as values"),
    **dict.fromkeys(("num_experts", "top_k_experts", "moe_intermediate_size", "expert_intermediate_size"),
                    KeyRule("inert", "read only with enable_moe_block")),
    "partial_rotary_factor": KeyRule("refused unless", "none", must_be(
        None, why="Gemma 4 sets its partial rotation per layer kind, in rope_parameters")),
    "output_router_logits": KeyRule("inert", "training's auxiliary loss"),
    **dict.fromkeys(("default_rope_type", "standardize", "serialize_explicit_per_layer_config"),
                    KeyRule("inert", "transformers' own bookkeeping, not a setting")),
}

ARCH = ArchSpec(
    "gemma4_text",
    ("Gemma4ForCausalLM",),
    gguf_arch="gemma4",
    rope_style="neox",
    linear_modules=LINEARS,
    vllm_lora_modules=LINEARS,
    vllm_lora_copies=vllm_value_lora,
    notes=("sliding-window and full-attention layers with their own head sizes; proportional RoPE on the full layers",
           "per-layer embeddings (PLE); the last layers share earlier layers' KV; k_eq_v full layers; a scalar on "
           "each layer's output; norms as stored (not 1 + w); soft-capped logits"),
    gguf=GGUFArch((
        ("context_length", ("max_position_embeddings",), "u32"),
        ("embedding_length", ("hidden_size",), "u32"),
        ("attention.head_count", ("num_attention_heads",), "u32"),
        ("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), "f32"),
        ("attention.sliding_window", ("sliding_window",), "u32"),
    ), GEMMA4_GGUF_RULES, write_freq_base_swa=True, write_swa_pattern=True, weight_suffixed=("layer_output_scale",),
        keep_f32=("per_layer_model_proj.weight",),  # llama.cpp's quantizer never quantizes it
        derived_hparams=_gguf_hparams, rope_freqs=rope_freqs,
        no_lora=(("per_layer_model_proj.weight", "llama.cpp multiplies by it without LoRA (a plain ggml_mul_mat)"),
                 ("per_layer_token_embd.weight", "a table lookup llama.cpp applies no LoRA to"))),
    mlx=MlxArch("gemma4_text", (mlx_config,), fixed_rules=MLX_RULES,
                notes=("global_head_dim, num_global_key_value_heads and the keys mlx-lm defaults to the E2B's "
                       "shape written as transformers computes them",)),
    refusals={"awq": "not built yet: tuneport's AWQ pass has no scale groups for Gemma 4's layers",
              "exl3": "not built yet for Gemma 4"},
)
