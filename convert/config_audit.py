"""The model-config audit: every ``config.json`` key that changes the computation is, per target, carried into
the artifact, folded into the weights, or refused with the reason — and a key the table does not know, at a
value other than transformers' default for that architecture, is refused rather than silently ignored.

A target keeps its rules as data (``KeyRule`` per key, see ``convert/gguf/config_keys.py``); ``audit`` applies
them to one config and returns the notes for the manifest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import UserError

Check = Callable[[Any, dict], "str | None"]  # (value, whole config) -> why this value cannot be honoured
How = Literal["carried", "folded", "capped", "refused unless", "inert"]

# Keys that never change what a causal LM computes at inference (bookkeeping, dropouts, token ids the
# tokenizer carries, training-only settings).
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "output_hidden_states", "output_attentions", "return_dict", "use_cache", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "initializer_range", "pad_token_id",
    "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "decoder_start_token_id", "cache_implementation", "attention_dropout", "resid_pdrop", "embd_pdrop",
    "hidden_dropout", "tokenizer_class", "_attn_implementation_autoset", "max_length", "num_return_sequences",
    "tie_encoder_decoder", "pruned_heads", "torchscript", "use_return_dict", "bad_words_ids",
})


@dataclass(frozen=True)
class KeyRule:
    """How one target treats one config key."""

    how: How
    what: str  # in words, for the manifest and docs/architectures.md
    check: Check | None = None  # returns the reason a value is refused (None: this value is honoured)


def must_be(*allowed: Any, why: str) -> Check:
    """A check that accepts only ``allowed`` values (``why``: what the engine does instead)."""
    def check(value: Any, cfg: dict) -> str | None:
        return None if value in allowed else why
    return check


@dataclass(frozen=True)
class AuditFinding:
    key: str
    value: Any
    rule: KeyRule | None  # None: a default value of a key the table does not list


@functools.lru_cache(maxsize=32)
def _class_defaults(model_type: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).to_dict()


def class_default(model_type: str, key: str) -> Any:
    """transformers' default for ``key`` of ``model_type`` (a missing sentinel when it has none)."""
    return _class_defaults(model_type).get(key, _MISSING)


_MISSING = object()


def effective_config(cfg: dict) -> dict:
    """``cfg`` as transformers computes with it: a key the file leaves out takes its class default (a Qwen3-MoE
    config without ``norm_topk_prob`` runs with False), so rules and derived values see what the model does."""
    try:
        defaults = _class_defaults(str(cfg.get("model_type")))
    except (ValueError, KeyError):  # a model_type transformers does not know: only the file's keys
        return dict(cfg)
    return {**cfg, **{k: v for k, v in defaults.items() if k not in cfg and k not in INERT_KEYS}}


def audit(cfg: dict, rules: Mapping[str, KeyRule], target: str) -> list[AuditFinding]:
    """Apply ``rules`` to every key of ``cfg`` (with transformers' defaults for the keys it leaves out): a
    UserError for the first value the target cannot honour (or an unknown key at a non-default value); else what
    was found, key by key."""
    model_type = str(cfg.get("model_type"))
    cfg = effective_config(cfg)
    found = []
    for key, value in cfg.items():
        if key in INERT_KEYS:
            continue
        rule = rules.get(key)
        if rule is None:
            default = class_default(model_type, key)
            if default is not _MISSING and _same(value, default):
                found.append(AuditFinding(key, value, None))
                continue
            raise UserError(
                f"config key {key!r} = {_short(value)} of this {model_type} model is not in tuneport's audit for "
                f"--target {target} (transformers' default: {_short(default)}), so tuneport cannot tell "
                "whether the engine computes the same",
                "export for a target that copies config.json (--target vllm), or report the key")
        if rule.how == "inert":
            continue
        if rule.check is not None and (why := rule.check(value, cfg)) is not None:
            raise UserError(f"{model_type} config {key} = {_short(value)} cannot be exported for --target {target}: "
                            f"{why}", "export for a target that copies config.json (--target vllm)")
        found.append(AuditFinding(key, value, rule))
    return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _short(value: Any) -> str:
    if value is _MISSING:
        return "none"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
