"""Which kind each layer of a model is, as transformers derives it from a config where more than one key can say it
(read by the architecture entries and by the targets' config fixes alike)."""

from __future__ import annotations


def lfm2_layer_kinds(cfg: dict) -> list[str]:
    """LFM2's layers ("conv" / "full_attention"): ``layer_types``, else ``full_attn_idxs``, else every layer
    attention (transformers' Lfm2Config)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    attention = cfg.get("full_attn_idxs")
    n = int(cfg["num_hidden_layers"])
    return ["full_attention" if attention is None or i in attention else "conv" for i in range(n)]


def granite_hybrid_layer_kinds(cfg: dict) -> list[str]:
    """Granite 4's layers ("mamba" / "attention"): ``layer_types`` as the hub writes them ("mamba", "attention") or as
    transformers 5 saves them ("linear_attention", "full_attention"), else every layer Mamba (transformers'
    GraniteMoeHybridConfig); an unknown kind is kept as it is, for the audit to name."""
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    return [names.get(t, t) for t in types] if types else ["mamba"] * int(cfg["num_hidden_layers"])


def granite_hybrid_experts(cfg: dict) -> int:
    """Granite 4's routed experts per layer as transformers builds them: ``num_local_experts``, 8 where the file leaves
    it out (GraniteMoeHybridConfig's default), 0 for the models without (H-Micro, H-1B, H-350M, Micro)."""
    return int(cfg.get("num_local_experts", 8) or 0)


def kv_heads_per_layer(cfg: dict, kinds: list[str], recurrent: str) -> list[int]:
    """llama.cpp's per-layer ``attention.head_count_kv``: 0 marks a recurrent layer (of kind ``recurrent``)."""
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    return [0 if kind == recurrent else kv for kind in kinds]
