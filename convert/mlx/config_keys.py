"""What mlx-lm does with each ``config.json`` key, per architecture (the config audit's rules for --target mlx).

mlx-lm builds a model from the fields of its ``ModelArgs`` and silently drops every other key, so a key that
changes the computation in transformers but is no field there (Qwen3's ``attention_bias``, Llama's
``hidden_act``) would be ignored. The rules, derived from mlx-lm's own classes:
- a ``ModelArgs`` field: read by mlx-lm (``archs.MlxArch.config_fixes`` put transformers 5's nested values
  where it reads them);
- a key transformers defines that mlx-lm does not read: refused unless at transformers' default;
- the keys below: how tuneport carries them, or why they change nothing.
Any other key at a non-default value is refused by ``config_audit.audit``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from ..config_audit import KeyRule, audit, effective_config
from .archs import mlx_arch_for


def _full_attention(value, cfg: dict) -> str | None:
    if value is None or all(t == "full_attention" for t in value):
        return None
    return f"mlx-lm runs every layer of {cfg.get('model_type')} with full attention; layer_types {sorted(set(value))}"


def _no_window(value, cfg: dict) -> str | None:
    if cfg.get("use_sliding_window") is False or not value or value >= int(cfg.get("max_position_embeddings") or 0):
        return None
    return f"mlx-lm's {cfg.get('model_type')} has no sliding window (a window of {value} tokens)"


COMMON: dict[str, KeyRule] = {
    "rope_parameters": KeyRule("carried", "as the top-level rope_theta / rope_scaling mlx-lm reads"),
    "layer_types": KeyRule("refused unless", "every layer full attention", _full_attention),
    "sliding_window": KeyRule("refused unless", "no window shorter than the context", _no_window),
    "use_sliding_window": KeyRule("inert", "see sliding_window"),
    "max_window_layers": KeyRule("inert", "see sliding_window"),
    "router_aux_loss_coef": KeyRule("inert", "a training loss"),
    "output_router_logits": KeyRule("inert", "returns the router's logits for that loss"),
    "router_jitter_noise": KeyRule("inert", "applied in training only"),
    "num_local_experts": KeyRule("carried", "as num_experts where mlx-lm reads that"),
    "pretraining_tp": KeyRule("inert", "transformers 5 computes the same for every value"),
    "max_position_embeddings": KeyRule("inert", "a context limit mlx-lm does not apply (RoPE scaling is in "
                                       "rope_scaling)"),
    "tie_word_embeddings": KeyRule("carried", "an untied model's lm_head is written, and mlx-lm uses it"),
}
# Keys an architecture's config fixes translate into fields mlx-lm reads.
FIXED: dict[str, dict[str, KeyRule]] = {
    "gemma3_text": {"layer_types": KeyRule("carried", "as sliding_window_pattern"),
                    "_sliding_window_pattern": KeyRule("inert", "layer_types is what counts")},
}


@functools.lru_cache(maxsize=32)
def mlx_read_fields(model_type: str) -> frozenset[str]:
    """The config keys mlx-lm's model for ``model_type`` reads (its ``ModelArgs`` fields)."""
    args = importlib.import_module(f"mlx_lm.models.{mlx_arch_for(model_type).mlx_model}").ModelArgs
    return frozenset(f.name for f in dataclasses.fields(args))


def fill_transformers_defaults(cfg: dict) -> list[str]:
    """Write, in place, transformers' default for each key mlx-lm reads that ``cfg`` leaves out: mlx-lm would
    run with its own default instead (a Qwen3-MoE config without ``norm_topk_prob`` is False in transformers).
    Returns the keys written."""
    effective = effective_config(cfg)
    filled = sorted(k for k in mlx_read_fields(str(cfg.get("model_type"))) if k not in cfg
                    and effective.get(k) is not None)
    cfg.update({k: effective[k] for k in filled})
    return filled


@functools.lru_cache(maxsize=32)
def mlx_config_rules(model_type: str) -> dict[str, KeyRule]:
    """The audit's rules for ``model_type`` exported to mlx-lm."""
    from transformers import AutoConfig

    module = mlx_arch_for(model_type).mlx_model
    read = mlx_read_fields(model_type)
    rules: dict[str, KeyRule] = {}
    for key, default in AutoConfig.for_model(model_type).to_dict().items():
        rules[key] = KeyRule("refused unless", f"transformers' default ({default!r}): mlx-lm's {module} does not read "
                             "it", lambda v, cfg, k=key, d=default: None if v == d else
                             f"mlx-lm's {module} does not read {k} (it runs as if it were {d!r})")
    rules.update(COMMON)
    rules.update(FIXED.get(model_type, {}))
    rules.update({k: KeyRule("carried", f"read by mlx-lm's {module}.ModelArgs") for k in read})
    return rules


def audit_mlx_config(cfg: dict) -> None:
    """Refuse (UserError) a config value mlx-lm would not honour; ``cfg`` as tuneport writes it for mlx-lm."""
    audit(cfg, mlx_config_rules(str(cfg.get("model_type"))), "mlx")
