"""What mlx-lm does with each ``config.json`` key, per architecture (the config audit's rules for --target mlx).

mlx-lm builds a model from the fields of its ``ModelArgs`` and silently drops every other key, so a key that
changes the computation in transformers but is no field there (Qwen3's ``attention_bias``, Llama's
``hidden_act``) would be ignored. The rules, derived from mlx-lm's own classes:
- a ``ModelArgs`` field: read by mlx-lm (``archs.MlxArch.config_fixes`` put transformers 5's nested values
  where it reads them);
- the keys below: how tuneport carries them, or why they change nothing.
``config_audit.audit`` refuses any other key transformers' model reads at a value that changes what it
computes (mlx-lm does not read it); keys transformers does not read are inert. A ``ModelArgs`` field transformers
does not read (Llama's ``rope_traditional``) is left out of the written config, so mlx-lm runs it as it runs the
hub's configs (``engine_only_keys``).
"""

from __future__ import annotations

import dataclasses
import functools

from ..config_audit import INERT_KEYS, KeyRule, audit, effective_config, yarn_untruncated
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
@functools.lru_cache(maxsize=32)
def mlx_read_fields(model_type: str) -> frozenset[str]:
    """The config keys mlx-lm's model for ``model_type`` reads (its ``ModelArgs`` fields)."""
    return frozenset(f.name for f in dataclasses.fields(mlx_arch_for(model_type).args()))


def fill_transformers_defaults(cfg: dict) -> list[str]:
    """Write, in place, transformers' default for each key mlx-lm reads that ``cfg`` leaves out: mlx-lm would
    run with its own default instead (a Qwen3-MoE config without ``norm_topk_prob`` is False in transformers).
    Returns the keys written."""
    effective = effective_config(cfg)
    filled = sorted(k for k in mlx_read_fields(str(cfg.get("model_type"))) if k not in cfg
                    and effective.get(k) is not None)
    cfg.update({k: effective[k] for k in filled})
    return filled


def _short_factors_differ(value, cfg: dict) -> str | None:
    """LongRoPE (Phi-3.5, Phi-4-mini): mlx-lm's SuScaledRoPE rotates with the long factors at every length;
    transformers uses the short ones up to original_max_position_embeddings."""
    if not isinstance(value, dict) or value.get("rope_type", value.get("type")) not in ("longrope", "su"):
        return None
    if value.get("short_factor") == value.get("long_factor"):
        return None
    return ("mlx-lm's SuScaledRoPE rotates with LongRoPE's long factors at every length; transformers uses the short "
            "factors up to original_max_position_embeddings "
            f"({value.get('original_max_position_embeddings', cfg.get('original_max_position_embeddings'))} tokens)")


def _rope_differs(value, cfg: dict) -> str | None:
    """RoPE settings mlx-lm computes otherwise: LongRoPE's short factors; YaRN untruncated (its YarnRoPE rounds the
    correction range to whole dimensions, transformers' truncate: true)."""
    yarn = isinstance(value, dict) and value.get("rope_type", value.get("type")) == "yarn"
    if yarn and value.get("truncate") is False:
        return yarn_untruncated("mlx-lm's YarnRoPE")
    return _short_factors_differ(value, cfg)


# Keys mlx-lm reads, at values it computes differently from transformers.
CHECKED = {"rope_scaling": _rope_differs, "rope_parameters": _rope_differs}


@functools.lru_cache(maxsize=32)
def mlx_config_rules(model_type: str) -> dict[str, KeyRule]:
    """The audit's rules for ``model_type`` exported to mlx-lm."""
    module = mlx_arch_for(model_type).mlx_model
    rules = {**COMMON, **mlx_arch_for(model_type).fixed_rules}
    rules.update({k: KeyRule("carried", f"read by mlx-lm's {module}.ModelArgs") for k in mlx_read_fields(model_type)})
    for key, check in CHECKED.items():
        if key in rules:
            rules[key] = KeyRule(rules[key].how, rules[key].what + "; LongRoPE only with equal short and long factors, "
                                 "YaRN only truncated",
                                 check)
    return rules


def engine_only_keys(cfg: dict) -> list[str]:
    """Keys of ``cfg`` mlx-lm reads and transformers' model does not, at a value other than mlx-lm's default:
    mlx-lm would compute with them, the reference does not."""
    from ..config_reads import judge_config

    judged = judge_config(cfg)
    defaults = mlx_field_defaults(str(cfg.get("model_type")))
    return sorted(k for k, v in judged.verdicts.items() if k in defaults and v.kind == "inert"
                  and k not in INERT_KEYS and v.value != defaults[k])


@functools.lru_cache(maxsize=32)
def mlx_field_defaults(model_type: str) -> dict:
    """mlx-lm's ``ModelArgs`` fields that have a default, with it."""
    args = mlx_arch_for(model_type).args()
    return {f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING}


def audit_mlx_config(cfg: dict) -> list[str]:
    """Refuse (UserError) a config value mlx-lm would not honour; ``cfg`` as tuneport writes it for mlx-lm. The
    audit's notes."""
    model_type = str(cfg.get("model_type"))
    module = mlx_arch_for(model_type).mlx_model
    found = audit(cfg, mlx_config_rules(model_type), "mlx", unhandled=f"mlx-lm's {module} does not read it")
    return found.notes(model_type)
