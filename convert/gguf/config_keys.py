"""The GGUF config audit: each ``config.json`` key judged by the rules of the architecture's entry
(``convert.arch.<model_type>``, vocabulary in ``gguf.config_rules``), and what the writer derives from the
config (a capped context, query-scale folds, notes for the manifest)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..arch import ARCHS
from ..config_audit import KeyRule, audit, effective_config
from .config_rules import NO_SLIDING_GRAPH, window_active

# model_type -> its rules (a view of the architecture table)
GGUF_CONFIG_RULES: dict[str, dict[str, KeyRule]] = {
    m: dict(a.gguf.config_rules) for m, a in ARCHS.items() if a.gguf is not None}


@dataclass
class GGUFConfigFacts:
    """What the audit decided for one export: metadata overrides, weight folds and notes for the manifest."""

    context_length: int | None = None
    q_norm_factor: float | None = None  # Gemma 3: the query scale folded into attn_q_norm
    q_proj_factor: float | None = None  # Gemma 2 (no q norm): into attn_q's rows and q_proj LoRA B
    notes: list[str] = field(default_factory=list)


def gemma_attention_scale_dim(model_type: str, cfg: dict) -> float:
    """The d of llama.cpp's 1/sqrt(d) query scale for Gemma 2 and 3."""
    if int(cfg["num_hidden_layers"]) == ARCHS[model_type].gguf.hidden_scaled_queries_at_layers:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return float(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def gguf_config_facts(model_type: str, cfg: dict) -> GGUFConfigFacts:
    """Audit ``cfg`` for GGUF (UserError on a value llama.cpp cannot honour) and derive what to write."""
    rules = GGUF_CONFIG_RULES.get(model_type)
    if rules is None:
        return GGUFConfigFacts()
    garch = ARCHS[model_type].gguf
    found = audit(cfg, rules, "gguf", unhandled="tuneport's GGUF writer does not carry it into llama.cpp")
    cfg = effective_config(cfg)
    facts = GGUFConfigFacts(notes=found.notes(model_type))
    if rules.get("sliding_window") is NO_SLIDING_GRAPH["sliding_window"] and window_active(cfg):
        facts.context_length = int(cfg["sliding_window"])
        facts.notes.append(f"context_length {facts.context_length}: the model's sliding window, which llama.cpp "
                           f"does not run for {model_type} (max_position_embeddings "
                           f"{cfg.get('max_position_embeddings')})")
    if (rule := rules.get("query_pre_attn_scalar")) is not None and rule.how == "folded":
        scalar = cfg.get("query_pre_attn_scalar")
        d = gemma_attention_scale_dim(model_type, cfg)
        if scalar and not math.isclose(float(scalar), d):
            factor, into = math.sqrt(d / float(scalar)), garch.query_fold
            setattr(facts, f"{into}_factor", factor)
            facts.notes.append(f"query_pre_attn_scalar {scalar} folded into {into} (x{factor:.6g}): "
                               f"llama.cpp scales queries by 1/sqrt({d:g})")
    return facts
