"""The model-config audit: every ``config.json`` key that changes what transformers' model computes is, per
target, carried into the artifact, folded into the weights, or refused with the reason. A key no rule names
counts only if transformers' model reads it (``config_reads``, derived from the installed transformers): a key
it never reads (``unsloth_version``) is inert, one at the value transformers derives anyway (``head_dim`` =
hidden / heads) is redundant, and one that changes the computation is refused, naming what differs, unless the
user accepts it (``--accept-config-key``, recorded as an accepted risk).

A target keeps its rules as data (``KeyRule`` per key, see ``convert/gguf/config_keys.py``); ``audit`` applies
them to one config and returns what it found, for the manifest's notes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import UserError

Check = Callable[[Any, dict], "str | None"]  # (value, whole config) -> why this value cannot be honoured
How = Literal["carried", "folded", "capped", "refused unless", "inert"]

# Keys transformers reads (or keeps) that never change what a causal LM computes at inference: bookkeeping,
# loading and parallelism plumbing, the attention kernel, dropouts and other training-only settings, and token
# ids the tokenizer carries. Each with the reason (docs/architectures.md lists them).
INERT_KEYS: dict[str, str] = {
    **dict.fromkeys(("architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path",
                     "auto_map", "tokenizer_class", "_attn_implementation_autoset",
                     "_commit_hash"), "bookkeeping: which class and files the model came from"),
    **dict.fromkeys(("dtype", "torch_dtype"), "the stored dtype: every target writes its own"),
    **dict.fromkeys(("attn_implementation", "_attn_implementation", "_experts_implementation",
                     "experts_implementation"), "which kernel computes attention (or the experts): the same "
                                                "math; tuneport's reference picks its own"),
    **dict.fromkeys(("output_hidden_states", "output_attentions", "return_dict", "use_return_dict", "use_cache",
                     "is_encoder_decoder", "chunk_size_feed_forward", "torchscript", "pruned_heads",
                     "tie_encoder_decoder", "cache_implementation", "max_length", "num_return_sequences",
                     "bad_words_ids", "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan",
                     "base_model_fsdp_plan", "gradient_checkpointing"),
                    "what a forward call returns, caching and parallelism plans: not the logits"),
    **dict.fromkeys(("id2label", "label2id", "problem_type"), "classification heads only"),
    **dict.fromkeys(("initializer_range", "attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                     "mlp_dropout", "dropout"), "training only (weight initialization, dropout)"),
    **dict.fromkeys(("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id",
                     "cls_token_id", "mask_token_id", "decoder_start_token_id"),
                    "token ids: the tokenizer and generation config carry them"),
}
# keys transformers 5 reads as one setting (it builds rope_parameters from a transformers 4 rope_scaling): accepting
# either accepts both
SAME_SETTING = {"rope_scaling": "rope_parameters", "rope_parameters": "rope_scaling"}
ACCEPTED: ContextVar[frozenset[str]] = ContextVar("accepted_config_keys", default=frozenset())


@contextmanager
def accepting(keys) -> Iterator[None]:
    """``--accept-config-key``: within this block the audit records these keys as accepted risks instead of
    refusing them."""
    token = ACCEPTED.set(frozenset(keys or ()))
    try:
        yield
    finally:
        ACCEPTED.reset(token)


@dataclass(frozen=True)
class KeyRule:
    """How one target treats one config key."""

    how: How
    what: str  # in words, for the manifest and docs/architectures.md
    check: Check | None = None  # returns the reason a value is refused (None: this value is honoured)


def yarn_untruncated(engine: str) -> str:
    """Why ``engine`` cannot run YaRN with ``truncate: false`` as transformers does (gpt-oss's RoPE, measured: head 64,
    base 150000, 4096 x 32 give the correction range 8.09-17.40; rounded to 8-18, pairs 9-17 turn up to 2.2e-4 rad per
    position away, 0.06 rad at 256 tokens, 0.9 at 4096; the logits of a tiny model 4.4e-3 apart over 16 tokens)."""
    return (f"YaRN with truncate: false, which {engine} cannot express: it rounds the correction range to whole "
            "dimensions (transformers' truncate: true), so RoPE pairs inside that range turn up to 2.2e-4 rad per "
            "position away from the trained angles for gpt-oss (0.06 rad at 256 tokens, 0.9 at 4096)")


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
    """``cfg`` as transformers computes with it: a key the file leaves out takes the value transformers' config
    class gives it for this file (a Qwen3-MoE config without ``norm_topk_prob`` runs with False; a Llama 3.1 config
    without ``head_dim`` with hidden / heads of its own sizes, not of the class's default sizes), so rules and
    derived values see what the model does."""
    from .config_reads import built_config

    built = built_config(cfg)
    if built is None:  # a model_type transformers does not know, or a config it cannot build: the file's keys
        return dict(cfg)
    return {**cfg, **{k: v for k, v in built.items() if k not in cfg and k not in INERT_KEYS}}


@dataclass
class AuditResult:
    """What the audit found in one config, for the manifest's notes."""

    findings: list[AuditFinding] = field(default_factory=list)
    inert: list[str] = field(default_factory=list)  # keys transformers' model does not read
    redundant: list[str] = field(default_factory=list)  # read, at the value transformers derives without them
    accepted: list[str] = field(default_factory=list)  # --accept-config-key: what would have been refused

    def notes(self, model_type: str) -> list[str]:
        notes = []
        if self.inert:
            notes.append(f"config keys transformers' {model_type} model does not read (inert): "
                         f"{', '.join(self.inert)}")
        if self.redundant:
            notes.append(f"config keys at the value transformers derives without them: {', '.join(self.redundant)}")
        notes += [f"accepted risk (--accept-config-key): {a}" for a in self.accepted]
        return notes


def audit(cfg: dict, rules: Mapping[str, KeyRule], target: str, *,
          unhandled: str = "tuneport's rules for this target do not say how the engine honours it") -> AuditResult:
    """Apply ``rules`` to every key of ``cfg`` (a ``config.json`` as read; the keys it leaves out at transformers'
    defaults). A key without a rule counts only if transformers' model reads it (``config_reads.judge_config``):
    inert and redundant keys are noted; one that changes what the model computes is refused (UserError naming
    what differs), like a value a rule refuses, unless ``accepting`` names it."""
    from .config_reads import judge_config

    model_type = str(cfg.get("model_type"))
    effective = effective_config(cfg)
    accepted = ACCEPTED.get()
    result = AuditResult()

    def refuse(key: str, message: str, hint: str) -> None:
        if key in accepted or SAME_SETTING.get(key) in accepted:
            result.accepted.append(f"{key} = {_short(effective[key])}: {message}")
            return
        raise UserError(message, f"{hint}; or pass --accept-config-key {key} to export anyway (recorded as an "
                                 "accepted risk)")

    judged = None
    for key, value in effective.items():
        if key in INERT_KEYS:
            continue
        rule = rules.get(key)
        if rule is not None:
            if rule.how == "inert":
                continue
            if rule.check is not None and (why := rule.check(value, effective)) is not None:
                refuse(key, f"{model_type} config {key} = {_short(value)} cannot be exported for --target "
                       f"{target}: {why}", "export for a target that copies config.json (--target vllm)")
            result.findings.append(AuditFinding(key, value, rule))
            continue
        if key not in cfg:
            result.findings.append(AuditFinding(key, value, None))  # what transformers computes with anyway
            continue
        default = class_default(model_type, key)
        judged = judged or judge_config(cfg)
        verdict = judged.verdicts.get(key)
        if verdict is not None and verdict.kind != "read" and default is not _MISSING and _same(value, default):
            result.findings.append(AuditFinding(key, value, None))  # written out at the class default: no note
        elif verdict is not None and verdict.kind == "inert":
            result.inert.append(key)
        elif verdict is not None and verdict.kind == "redundant":
            result.redundant.append(key)
        elif verdict is not None:
            refuse(key, f"config key {key!r} = {_short(value)} changes what transformers' {model_type} model "
                   f"computes ({verdict.describe_difference()}), and {unhandled}",
                   "export for a target that copies config.json (--target vllm), or report the key")
        else:
            refuse(key, f"config key {key!r} = {_short(value)} of this {model_type} model is not in tuneport's "
                   f"audit for --target {target} (transformers' default: {_short(default)}), and transformers "
                   "builds no model from this config to tell whether it reads it",
                   "export for a target that copies config.json (--target vllm), or report the key")
    return result


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _short(value: Any) -> str:
    if value is _MISSING:
        return "none"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
