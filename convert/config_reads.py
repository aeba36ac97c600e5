"""Which ``config.json`` keys transformers' model for an architecture reads, derived from the installed
transformers (nothing here is typed by hand):

- a trace: a tiny model of the architecture is built and run (prefill and one decode step) with its config's
  attribute reads recorded, which covers the shared code it calls (RoPE, masks, caches, weight tying);
- a scan of the modeling module's source, limited to the classes that model instantiates: every
  ``config.X``, ``getattr(config, "X", fallback)`` and ``hasattr(config, "X")``, which covers the branches the
  tiny model did not take, and gives the fallback a key left out of the file is computed with;
- the config class itself: a key the model never reads can still set one it does (Qwen2's
  ``use_sliding_window`` decides its ``layer_types``), which ``judge_config`` finds by building the config
  with and without the key.

``judge_config`` then sorts the keys of one ``config.json``: *inert* (transformers does not know the key, and
nothing it computes with changes when the key is removed: ``unsloth_version``), *redundant* (a key transformers
knows, at the value it derives without it: ``head_dim`` = hidden / heads, a ``rope_scaling`` of type
``default`` spelled out) or *read* (removing it changes what the model reads, which ``differs`` names). The
read sets are cached per transformers version under ``cache_dir()/config-reads``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
import json
import logging
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

from .config_source_scan import MISSING, config_fields, plumbing, scan_config_class, scan_module

log = logging.getLogger(__name__)

DERIVATION_VERSION = 2  # bump when the derivation changes: cached read sets are recomputed
# The tiny model the trace builds; a key the architecture's config class does not define is not added.
TRACE_SIZES = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 64,
    "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "shared_expert_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}

# model types whose default config cannot be traced as it is: Granite 4's makes every layer Mamba, and transformers'
# cache then fails the one-token step ("get_seq_length can only be called on Attention layers")
TRACE_OVERRIDES = {"granitemoehybrid": {"layer_types": ["mamba", "attention"] * 3}}


@dataclass(frozen=True)
class _Unknown:
    """A value the derivation could not compute (a fallback expression it cannot evaluate): equal only to the
    same failure, never to a value."""

    source: str

    def __repr__(self) -> str:
        return f"<not computable: {self.source}>"


@dataclass(frozen=True)
class ReadSet:
    """What transformers' model for ``model_type`` reads from its config."""

    model_type: str
    transformers_version: str
    attributes: frozenset[str]  # config attributes read (trace and scan)
    traced: frozenset[str]  # of those, the ones the tiny model's run read
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> fallback expressions (source)
    config_reads: frozenset[str] = frozenset()  # attributes the config class itself computes from (self.X)
    class_keys: frozenset[str] = frozenset()  # the config class's keys (dataclass fields, attribute aliases)
    scanned: frozenset[str] = frozenset()  # read in the modeling module's source

    def own_keys(self) -> frozenset[str]:
        """The read attributes that are this architecture's own: its config class's keys, and what its modeling
        code reads (the rest are probes of transformers' shared code, read only when a config sets them)."""
        return frozenset(a for a in self.attributes if a in self.class_keys or a in self.scanned)

    def to_json(self) -> dict:
        return {"model_type": self.model_type, "transformers_version": self.transformers_version,
                "attributes": sorted(self.attributes), "traced": sorted(self.traced),
                "fallbacks": {k: list(v) for k, v in sorted(self.fallbacks.items())},
                "config_reads": sorted(self.config_reads), "class_keys": sorted(self.class_keys),
                "scanned": sorted(self.scanned), "derivation": DERIVATION_VERSION}

    @classmethod
    def from_json(cls, d: dict) -> ReadSet:
        return cls(d["model_type"], d["transformers_version"], frozenset(d["attributes"]), frozenset(d["traced"]),
                   {k: tuple(v) for k, v in d["fallbacks"].items()}, frozenset(d["config_reads"]),
                   frozenset(d["class_keys"]), frozenset(d["scanned"]))


Kind = Literal["inert", "redundant", "read"]


@dataclass(frozen=True)
class KeyVerdict:
    """One key of a ``config.json``, judged against what the model reads."""

    key: str
    value: Any
    kind: Kind
    differs: tuple[tuple[str, Any, Any], ...] = ()  # read: (attribute, with the key, without it)

    def describe_difference(self) -> str:
        parts = [f"{attr} {_short(with_)} (without the key: {_short(without)})" for attr, with_, without in
                 self.differs[:3]]
        return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Deriving the read set


def transformers_version() -> str:
    import transformers

    return transformers.__version__


@functools.lru_cache(maxsize=64)
def read_set(model_type: str) -> ReadSet | None:
    """The read set of ``model_type`` for the installed transformers (None: transformers has no causal LM for it)."""
    from .cache import cache_dir

    version = transformers_version()
    path = cache_dir() / "config-reads" / f"{version}-d{DERIVATION_VERSION}" / f"{model_type}.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        data = json.loads(path.read_text())
        if data.get("derivation") == DERIVATION_VERSION and data["transformers_version"] == version:
            return ReadSet.from_json(data)
    found = derive_read_set(model_type)
    if found is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(found.to_json(), indent=1))
            tmp.replace(path)
    return found


_TRACE_LOCK = threading.Lock()


def derive_read_set(model_type: str) -> ReadSet | None:
    """Trace a tiny model of ``model_type`` and scan its modeling source (see the module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except (ValueError, KeyError):
        return None
    sizes = {**{k: v for k, v in TRACE_SIZES.items() if k in defaults}, **TRACE_OVERRIDES.get(model_type, {})}
    with _quiet():
        config = AutoConfig.for_model(model_type, **sizes)
        cls = type(config)
        reads: set[str] = set()
        aliases = dict(getattr(cls, "attribute_map", {}) or {})
        original = cls.__getattribute__

        def recording(self, name: str):
            if not name.startswith("__"):
                reads.add(aliases.get(name, name))
            return original(self, name)

        with _TRACE_LOCK:
            cls.__getattribute__ = recording  # type: ignore[method-assign]
            try:
                try:
                    model = AutoModelForCausalLM.from_config(config).eval()
                except ValueError:  # no causal LM class for this model_type
                    return None
                with torch.no_grad():
                    ids = torch.tensor([[3, 4, 5, 6]])
                    out = model(ids, use_cache=True)
                    model(torch.tensor([[7]]), past_key_values=out.past_key_values, use_cache=True)
            finally:
                cls.__getattribute__ = original  # type: ignore[method-assign]
    classes = {type(m).__name__ for m in model.modules()} | {c.__name__ for c in type(model).__mro__}
    scanned, fallbacks = scan_module(importlib.import_module(type(model).__module__), classes)
    config_reads = scan_config_class(cls)
    traced = frozenset(aliases.get(r, r) for r in reads if not plumbing(cls, r))
    own = frozenset(aliases.get(r, r) for r in scanned if not plumbing(cls, r))
    class_keys = config_fields(cls) | frozenset(aliases.values())
    return ReadSet(model_type, transformers_version(), traced | own, traced,
                   {k: tuple(v) for k, v in fallbacks.items()}, config_reads, class_keys, own)


# ---------------------------------------------------------------------------------------------------------------
# Judging one config


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _build(model_type: str, cfg: dict):
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    with _quiet():  # a copy: config classes standardize nested dicts (rope_scaling) in place; the special floats
        # transformers' JSON reader decodes ({"__float__": "Infinity"}: Granite 4's time_step_limit) decoded alike
        return cls.from_dict(decode_special_floats(copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type"})))


SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj: Any) -> Any:
    """``obj`` with transformers 5's JSON tags for floats JSON cannot hold (``{"__float__": "Infinity"}``) decoded, as
    its config reader does."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def built_config(cfg: dict) -> dict | None:
    """``cfg`` as transformers' config class builds it (``to_dict``: every key, derived ones computed from this
    file's values); None when transformers does not know the model_type or cannot build the config."""
    text = json.dumps(cfg, sort_keys=True, default=repr)
    return _built(text)


@functools.lru_cache(maxsize=64)
def _built(text: str) -> dict | None:
    cfg = json.loads(text)
    try:
        return _build(str(cfg.get("model_type")), cfg).to_dict()
    except Exception:  # noqa: BLE001 - unknown model_type or a config transformers refuses
        return None


def _evaluate(source: str, config) -> Any:
    names = {"config": config, "self": SimpleNamespace(config=config), "text_config": config}
    safe = {"int": int, "float": float, "len": len, "min": min, "max": max, "getattr": getattr,
            "hasattr": hasattr, "None": None, "True": True, "False": False}
    try:
        return eval(compile(source, "<fallback>", "eval"), {"__builtins__": safe}, names)  # noqa: S307
    except Exception:  # noqa: BLE001 - an expression the derivation cannot evaluate
        return _Unknown(source)


def _value(config, attr: str, reads: ReadSet) -> Any:
    """What the model computes with for ``attr``: the attribute, else each fallback it is read with."""
    try:
        value = getattr(config, attr)
    except AttributeError:
        fallbacks = reads.fallbacks.get(attr, ())
        values = [_evaluate(f, config) for f in fallbacks]
        if not values:
            return MISSING
        return values[0] if all(_same(v, values[0]) for v in values) else _Unknown(" / ".join(fallbacks))
    except Exception as e:  # noqa: BLE001 - transformers 5.19's own error for a per-layer attribute (Gemma 4's head_dim)
        return _Unknown(f"{attr} per layer ({type(e).__name__})")
    return value


def _plain(value: Any) -> bool:
    """Data a config holds (what a JSON file can say, and torch dtypes), not a helper object it keeps."""
    import torch

    return value is None or value is MISSING or isinstance(value, (bool, int, float, str, list, tuple, dict,
                                                                     torch.dtype, _Unknown))


def _view(config, reads: ReadSet) -> dict[str, Any]:
    values = {a: _value(config, a, reads) for a in sorted(reads.attributes)}
    return {a: v for a, v in values.items() if _plain(v)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _Unknown) or isinstance(b, _Unknown):
        return a == b
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (a == b and type(a) is type(b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class ConfigJudgement:
    """Every key of one ``config.json``, judged (``None`` reads: transformers has no causal LM for it)."""

    model_type: str
    verdicts: dict[str, KeyVerdict]
    reads: ReadSet | None

    def of(self, kind: Kind) -> list[KeyVerdict]:
        return [v for v in self.verdicts.values() if v.kind == kind]


def judge_config(cfg: dict) -> ConfigJudgement:
    """Judge each key of ``cfg`` (a ``config.json`` as read) against what transformers' model reads."""
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=repr).encode()).hexdigest()
    return _judge(key, json.dumps(cfg, default=repr))


@functools.lru_cache(maxsize=64)
def _judge(_digest: str, text: str) -> ConfigJudgement:
    cfg = json.loads(text)
    model_type = str(cfg.get("model_type"))
    reads = read_set(model_type)
    if reads is None:
        return ConfigJudgement(model_type, {}, None)
    try:
        full = _build(model_type, cfg)
    except Exception as e:  # noqa: BLE001 - transformers cannot build this config: nothing can be judged
        log.debug("config of %s does not build: %s", model_type, e)
        return ConfigJudgement(model_type, {}, reads)
    aliases = dict(getattr(type(full), "attribute_map", {}) or {})
    with_all = _view(full, reads)
    verdicts: dict[str, KeyVerdict] = {}
    for k, value in cfg.items():
        if k == "model_type":
            continue
        attr = aliases.get(k, k)
        try:
            without = _view(_build(model_type, {x: v for x, v in cfg.items() if x != k}), reads)
        except Exception:  # noqa: BLE001 - transformers cannot build the config without it: it is read
            verdicts[k] = KeyVerdict(k, value, "read", ((attr, value, "(the config does not build)"),))
            continue
        differs = tuple(sorted(((a, with_all[a], without.get(a, MISSING)) for a in with_all
                                if not _same(with_all[a], without.get(a, MISSING))), key=lambda d: d[0] != attr))
        if differs:
            verdicts[k] = KeyVerdict(k, value, "read", differs)
        else:
            known = (attr in reads.attributes or attr in reads.config_reads or attr in config_fields(type(full))
                     or inspect.getattr_static(type(full), attr, MISSING) is not MISSING
                     or attr not in vars(full))  # consumed by the config class (rope_theta into rope_parameters)
            verdicts[k] = KeyVerdict(k, value, "redundant" if known else "inert")
    return ConfigJudgement(model_type, verdicts, reads)


def _short(value: Any) -> str:
    if value is MISSING:
        return "none"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
