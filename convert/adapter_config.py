"""What each ``adapter_config.json`` key means to tuneport: honoured (applied by the reader or the merge), only
for training, or refused with the reason; the values PEFT writes for the honoured ones; configs other tools write
under the same name; and the 16-bit base of an adapter trained over a 4-bit one."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from .errors import UserError

_INIT_CHANGES_BASE = ("pissa", "olora", "corda", "loftq")


def _init_refusal(v: object) -> str:
    if isinstance(v, str) and v.lower().startswith(_INIT_CHANGES_BASE):
        return (
            f"init_lora_weights={v!r} changes the base weights when PEFT loads the adapter; convert it to a "
            "plain LoRA with PEFT's save_pretrained(path_initial_model_for_weight_conversion=...)"
        )
    return ""


def _set(reason: str) -> Callable[[object], str]:
    """A refusal that applies when the option is set (not None/False/empty)."""
    return lambda v: reason if v not in (None, False, {}, [], "", 0) else ""


# How each adapter_config.json key is treated. "honoured" keys are applied by the reader or merge;
# "training" keys change nothing at inference; a callable returns a refusal reason ("" = fine).
CONFIG_KEYS: dict[str, str | Callable[[object], str]] = {
    **dict.fromkeys(
        ["r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora", "modules_to_save",
         "fan_in_fan_out", "bias", "lora_bias", "target_modules", "exclude_modules", "layers_to_transform",
         "layers_pattern", "ensure_weight_tying", "target_parameters"],
        "honoured",
    ),
    **dict.fromkeys(
        ["lora_dropout", "inference_mode", "task_type", "base_model_name_or_path", "revision", "auto_mapping",
         "peft_version", "megatron_core", "qalora_group_size", "runtime_config", "eva_config",
         "lora_ga_config", "modules_to_tie", "target_modules_to_tie"],
        "training",
    ),
    "peft_type": lambda v: "" if str(v).upper() == "LORA" else f"peft_type={v!r}: only LoRA adapters are supported",
    "init_lora_weights": _init_refusal,
    "loftq_config": _set("LoftQ adapters expect the LoftQ-quantized base, not the original weights"),
    "corda_config": lambda v: "",  # only meaningful with init_lora_weights='corda', refused there
    "alora_invocation_tokens": _set("Activated LoRA (aLoRA) applies only after its invocation tokens; "
                                    "a merged or exported copy would apply it everywhere"),
    "layer_replication": _set("layer_replication changes the model's layer structure"),
    "use_bdlora": _set("block-diagonal LoRA (BD-LoRA) is not supported"),
    "use_qalora": _set("QALoRA adapters belong to a quantized base"),
    "megatron_config": _set("Megatron-parallel LoRA layers are not supported"),
    "trainable_token_indices": _set("trainable tokens (trainable_token_indices) are not supported yet: "
                                    "merge with PEFT's merge_and_unload() first"),
    "velora_config": _set("VeLoRA is not supported"),
    "monteclora_config": _set("MonteCLoRA is not supported"),
    "kasa_config": _set("KaSA is not supported"),
    "arrow_config": _set("Arrow routing between several LoRAs is not supported"),
}


def read_adapter_config(path: Path) -> dict:
    cfg_path = path / "adapter_config.json"
    if not cfg_path.exists():
        raise UserError(
            f"{path} has no adapter_config.json",
            "pass the directory PEFT's save_pretrained() wrote (it holds adapter_config.json and the weights)",
        )
    try:
        cfg = json.loads(cfg_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise UserError(f"{cfg_path} is not valid JSON ({e})", "repair or re-save the adapter") from e
    return cfg


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _names(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _layers(v: object) -> bool:
    items = v if isinstance(v, list) else [v]
    return all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items)


# The values the honoured keys may take (None always passes): (test, what the value must be)
VALUE_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "r": (_positive_int, "a positive integer"),
    "lora_alpha": (_finite, "a finite number"),
    "target_modules": (lambda v: isinstance(v, str) or _names(v), "a list of module names or a regular expression"),
    "modules_to_save": (_names, "a list of module names"),
    "layers_to_transform": (_layers, "a layer index or a list of them"),
    "bias": (lambda v: v in ("none", "all", "lora_only"), "'none', 'all' or 'lora_only'"),
    **{k: (lambda v: isinstance(v, bool), "true or false")
       for k in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias")},
}


# Repositories of 4-bit bases fine-tuning tools train QLoRA adapters on (Unsloth: X-bnb-4bit, X-unsloth-bnb-4bit)
_QUANTIZED_REPO = re.compile(r"(?:-unsloth)?-bnb-(?:4|8)bit$", re.IGNORECASE)


def unquantized_name(name: str | None) -> str | None:
    """The 16-bit repository of a bitsandbytes base an adapter names (Unsloth publishes both: ``unsloth/X`` beside
    ``unsloth/X-bnb-4bit`` and ``unsloth/X-unsloth-bnb-4bit``); None when ``name`` is not one."""
    if not isinstance(name, str) or not _QUANTIZED_REPO.search(name):
        return None
    return _QUANTIZED_REPO.sub("", name)


def quantized_base_note(adapter_name: str, cfg: dict) -> str | None:
    """What an export says of an adapter trained over a 4-bit base: it is applied to 16-bit weights."""
    named = cfg.get("base_model_name_or_path")
    if (plain := unquantized_name(named)) is None:
        return None
    return (f"adapter {adapter_name} was trained over the 4-bit {named} (QLoRA); it is applied to the 16-bit base "
            f"given (that repository's 16-bit weights: {plain})")


def value_refusals(cfg: dict) -> list[str]:
    """The honoured keys whose values are not what PEFT writes (a string rank, a NaN alpha, a bad pattern)."""
    problems = [f"{key}={cfg[key]!r} must be {what}" for key, (ok, what) in VALUE_RULES.items()
                if cfg.get(key) is not None and not ok(cfg[key])]
    for key, ok, what in (("rank_pattern", _positive_int, "a positive integer"),
                          ("alpha_pattern", _finite, "a finite number")):
        patterns = cfg.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            problems.append(f"{key}={patterns!r} must be an object {{module pattern: value}}")
            continue
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as e:
                problems.append(f"{key} key {pattern!r} is not a regular expression ({e})")
            if not ok(value):
                problems.append(f"{key}[{pattern!r}]={value!r} must be {what}")
    return problems


# Keys of adapter_config.json files other tools write under the same name
MLX_LM_ADAPTER_KEYS = frozenset({"lora_parameters", "fine_tune_type", "lora_layers", "num_layers"})


def foreign_adapter(cfg: dict) -> str | None:
    """Why ``cfg`` is not a PEFT adapter config at all (one reason, not one per key), or None."""
    if "peft_type" in cfg or "r" in cfg:
        return None
    if MLX_LM_ADAPTER_KEYS & cfg.keys():
        return ("this adapter_config.json is mlx-lm's (mlx_lm.lora: lora_parameters, num_layers), not PEFT's: serve "
                "it with --engine mlx over its MLX base; tuneport exports PEFT adapters")
    return ("this adapter_config.json has neither peft_type nor r: it is not a PEFT LoRA adapter "
            f"(its keys: {', '.join(sorted(cfg)[:6])})")


def config_refusals(cfg: dict) -> list[str]:
    """Every reason tuneport cannot apply this adapter config faithfully."""
    if (why := foreign_adapter(cfg)) is not None:
        return [why]
    problems = value_refusals(cfg)
    for key, value in cfg.items():
        rule = CONFIG_KEYS.get(key)
        if rule is None:
            if value not in (None, False, {}, [], ""):
                problems.append(f"unknown PEFT option {key}={value!r}; tuneport does not know how to apply it")
        elif callable(rule):
            if reason := rule(value):
                problems.append(reason)
    for key in ("r", "lora_alpha"):
        if cfg.get(key) is None:
            problems.append(f"adapter_config.json lacks '{key}'")
    return problems
