"""A PEFT LoRA adapter directory normalized into per-module deltas.

For each target module: ``A [r, in]``, ``B [out, r]`` and PEFT's effective scale (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` / ``alpha_pattern`` override per module with PEFT's
key-suffix rule). DoRA magnitudes, ``modules_to_save`` replacements, embedding LoRA and
``fan_in_fan_out`` are kept. Every config flag is honoured, ignored because it only affects training,
or refused with a reason: see ``adapter_config.CONFIG_KEYS``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter_config import config_refusals, read_adapter_config
from .checkpoint import Checkpoint, resolve_hub_path
from .errors import UserError
from .options import model_name
from .safetensors_file import SafetensorsFile

PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?P<module>.+?)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
    r"(?:\.[A-Za-z0-9_]+)??(?:\.(?P<param>weight|bias))?$"
)
_FULL_KEY = re.compile(
    r"^(?P<module>.+?)(?:\.(?P<wrap>modules_to_save|original_module|base_layer)(?:\.[A-Za-z0-9_]+)??)?"
    r"\.(?P<param>weight|bias)$"
)


def pattern_value(patterns: dict, module: str):
    """PEFT's ``get_pattern_key``: the first key that matches a dot-bounded suffix of ``module``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


@dataclass
class LoraModule:
    """One adapted module: ``delta = scale * B @ A`` shaped like the base weight."""

    module: str  # HF module path, e.g. "model.layers.0.self_attn.q_proj"
    kind: str  # "linear" or "embedding"
    A: torch.Tensor
    B: torch.Tensor
    rank: int
    alpha: float
    scale: float
    magnitude: torch.Tensor | None = None  # DoRA
    bias: torch.Tensor | None = None  # lora_bias: lora_B's bias
    fan_in_fan_out: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.weight"

    def base_shape(self) -> tuple[int, ...]:
        out, inp = self.B.shape[0], self.A.shape[1]
        return (inp, out) if (self.kind == "embedding" or self.fan_in_fan_out) else (out, inp)


@dataclass
class ParamLora:
    """A LoRA on a raw parameter (PEFT ``target_parameters``), before it is resolved against the base:
    for a 3-D expert parameter ``[E, out, in]``, ``A [E·r, in]`` (expert-major rows) and ``B [out, r·E]``
    (rank-major columns), PEFT's ``ParamWrapper`` layout; a 2-D parameter is a plain LoRA."""

    container: str  # the module holding the parameter, ``.base_layer`` wrappers removed
    A: torch.Tensor
    B: torch.Tensor


@dataclass
class Adapter:
    path: Path
    name: str
    config: dict
    modules: dict[str, LoraModule] = field(default_factory=dict)  # by target tensor name
    replacements: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensors by base tensor name
    # why each replacement is there: "modules_to_save", "base_layer" (a saved embedding layer) or "bias"
    replacement_origin: dict[str, str] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    file: Path | None = None
    # LoRAs on raw parameters (MoE experts), resolved into per-expert ``modules`` by convert.experts
    param_loras: list[ParamLora] = field(default_factory=list)

    @property
    def use_dora(self) -> bool:
        return any(m.magnitude is not None for m in self.modules.values())

    @property
    def ranks(self) -> list[int]:
        return sorted({m.rank for m in self.modules.values()})

    @property
    def target_suffixes(self) -> list[str]:
        return sorted({m.module.rsplit(".", 1)[-1] for m in self.modules.values()})

    @property
    def modules_to_save(self) -> list[str]:
        return list(self.config.get("modules_to_save") or [])

    def flags(self) -> dict[str, object]:
        c = self.config
        return {
            "use_rslora": bool(c.get("use_rslora")),
            "use_dora": bool(c.get("use_dora")),
            "rank_pattern": dict(c.get("rank_pattern") or {}),
            "alpha_pattern": dict(c.get("alpha_pattern") or {}),
            "modules_to_save": self.modules_to_save,
            "fan_in_fan_out": bool(c.get("fan_in_fan_out")),
            "bias": c.get("bias", "none"),
            "lora_bias": bool(c.get("lora_bias")),
            "layers_to_transform": c.get("layers_to_transform"),
            "embedding_lora": any(m.kind == "embedding" for m in self.modules.values()),
            "target_modules_regex": isinstance(c.get("target_modules"), str)
            and c.get("target_modules") != "all-linear",
        }


def _load_tensors(path: Path, allow_pickle: bool) -> tuple[dict[str, torch.Tensor], Path]:
    st = path / "adapter_model.safetensors"
    if st.exists():
        sf = SafetensorsFile(st)
        return {name: sf.read(name) for name in sf.tensors}, st
    for name in ("adapter_model.bin", "adapter_model.pt"):
        p = path / name
        if p.exists():
            if not allow_pickle:
                raise UserError(
                    f"{path} only has pickle weights ({name})",
                    "pickle files can run code when loaded; pass --allow-pickle if you trust them",
                )
            try:
                return dict(torch.load(p, map_location="cpu", weights_only=True)), p
            except Exception as e:
                raise UserError(f"cannot load {p} with weights_only=True ({type(e).__name__})",
                                "re-save the adapter with safetensors") from e
    raise UserError(f"{path} has no adapter_model.safetensors", "pass a complete PEFT adapter directory")


def resolve_adapter_path(spec: str | Path, allow_pickle: bool = False) -> Path:
    """A local adapter (PEFT directory or GGUF LoRA file) as is; otherwise a hub id, downloaded."""
    patterns = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja"]
    return resolve_hub_path(spec, patterns + (["*.bin", "*.pt"] if allow_pickle else []),
                            "an adapter directory or file")


def load_adapter(path: str | Path, name: str | None = None, allow_pickle: bool = False) -> Adapter:
    """Read and normalize a PEFT adapter directory (or hub id); refuse what cannot be applied faithfully."""
    name = name or model_name(path)  # a hub id's name, not its snapshot's hash
    path = resolve_adapter_path(path, allow_pickle)
    if not path.is_dir():
        raise UserError(f"adapter {path} does not exist or is not a directory", "pass a PEFT adapter directory")
    cfg = read_adapter_config(path)
    problems = config_refusals(cfg)
    if problems:
        raise UserError(f"cannot apply adapter {path}: " + "; ".join(problems), "")
    tensors, file = _load_tensors(path, allow_pickle)
    for key, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise UserError(
                f"adapter {path} has NaN or Inf values in {key}",
                "training diverged: use an earlier checkpoint or lower the learning rate",
            )
    adapter = Adapter(path=path, name=name, config=cfg, file=file)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    adapter.dtype = floats[0] if floats else torch.float32
    _parse_tensors(adapter, tensors)
    return adapter


def module_scale(adapter: Adapter, name: str, rank: int) -> tuple[float, float]:
    """(alpha, PEFT's scale) of the LoRA on ``name`` with ``rank`` rows, by the config's patterns (PEFT's
    suffix rule); a UserError when the config says another rank."""
    cfg = adapter.config
    expected = int(pattern_value(cfg.get("rank_pattern") or {}, name) or cfg["r"])
    if expected != rank:
        raise UserError(f"adapter {adapter.path}: {name} has rank {rank}, config says {expected}",
                        "adapter_config.json does not belong to these weights")
    alpha = float(pattern_value(cfg.get("alpha_pattern") or {}, name) or cfg["lora_alpha"])
    return alpha, alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _parse_tensors(adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
    cfg = adapter.config
    parts: dict[str, dict[str, torch.Tensor]] = {}
    wrapped: dict[str, dict[str, torch.Tensor]] = {}  # module -> {wrap.param: tensor}
    unknown = []
    for key, t in tensors.items():
        k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if m := _LORA_KEY.match(k):
            part = m["part"] + (".bias" if m["param"] == "bias" else "")
            parts.setdefault(m["module"], {})[part] = t
        elif m := _FULL_KEY.match(k):
            wrapped.setdefault(m["module"], {})[f"{m['wrap'] or 'plain'}.{m['param']}"] = t
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"adapter {adapter.path} has tensors tuneport does not recognise: {unknown[:3]}",
                        "only LoRA adapters saved by PEFT are supported")

    fifo = bool(cfg.get("fan_in_fan_out"))
    # modules holding a targeted parameter: named in target_parameters ("mlp.experts.down_proj"), or
    # transformers' fused "experts" for bare names ("down_proj"), or wrapped more than once
    targets = cfg.get("target_parameters") or []
    containers = {t.rsplit(".", 2)[-2] if "." in t else "experts" for t in targets}
    for module, p in parts.items():
        container = re.sub(r"(\.base_layer)+$", "", module)
        if targets and (container != module or container.rsplit(".", 1)[-1] in containers) \
                and set(p) == {"lora_A", "lora_B"}:
            adapter.param_loras.append(ParamLora(container, p["lora_A"], p["lora_B"]))
            continue
        kind = "embedding" if "lora_embedding_A" in p or "lora_embedding_B" in p else "linear"
        a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if kind == "embedding" else ("lora_A", "lora_B")
        if lacks := [k for k in (a_key, b_key) if k not in p]:
            raise UserError(f"adapter {adapter.path}: module {module} lacks {lacks[0]}",
                            "the adapter file is incomplete: re-save it")
        A, B = p[a_key], p[b_key]
        for part, t in ((a_key, A), (b_key, B)):
            if t.dim() != 2 or not t.is_floating_point():
                raise UserError(f"adapter {adapter.path}: {module}.{part} is {str(t.dtype).removeprefix('torch.')} "
                                f"{list(t.shape)}, not a matrix of floating-point numbers",
                                "the adapter file is corrupt: re-save it")
        rank = A.shape[0]
        if B.shape[-1] != rank:
            raise UserError(f"adapter {adapter.path}: {module} has A rank {rank} but B {list(B.shape)}",
                            "the adapter file is corrupt: re-save it")
        mod_alpha, scale = module_scale(adapter, module, rank)
        magnitude = p.get("lora_magnitude_vector")
        if magnitude is not None and kind == "embedding":
            raise UserError(f"adapter {adapter.path}: DoRA on embedding {module} is not supported", "")
        adapter.modules[f"{module}.weight"] = LoraModule(
            module=module, kind=kind, A=A, B=B, rank=rank, alpha=mod_alpha, scale=scale,
            magnitude=magnitude.reshape(-1) if magnitude is not None else None,
            bias=p.get("lora_B.bias"), fan_in_fan_out=fifo and kind == "linear",
        )
    if not parts and not wrapped:
        raise UserError(f"adapter {adapter.path} holds no LoRA tensors",
                        "pass the directory PEFT's save_pretrained() wrote after training")
    if cfg.get("use_dora") and not adapter.use_dora:
        raise UserError(f"adapter {adapter.path} says use_dora but has no lora_magnitude_vector",
                        "the adapter file is incomplete: re-save it")

    # Full tensors: a trained modules_to_save copy wins; otherwise a saved base layer (PEFT stores the
    # embedding layers it was trained over, resized ones included) or a trained bias replaces the base.
    for module, ts in wrapped.items():
        for param in ("weight", "bias"):
            origin = next((w for w in ("modules_to_save", "plain", "base_layer") if f"{w}.{param}" in ts), None)
            if origin is None:
                continue
            t = ts[f"{origin}.{param}"]
            if origin == "plain":
                leaf = module.rsplit(".", 1)[-1]
                origin = "modules_to_save" if leaf in adapter.modules_to_save else (
                    "bias" if param == "bias" else "base_layer")
            adapter.replacements[f"{module}.{param}"] = t
            adapter.replacement_origin[f"{module}.{param}"] = origin


def saved_base_layers(adapter: Adapter, base: Checkpoint) -> tuple[set[str], set[str]]:
    """The base layers PEFT saved beside the adapter (e.g. ``embed_tokens.base_layer``), split into those
    identical to ``base`` (safe to drop) and those that differ (a resized or retrained embedding)."""
    same, differ = set(), set()
    for name, origin in adapter.replacement_origin.items():
        if origin != "base_layer":
            continue
        saved = adapter.replacements[name]
        equal = (name in base and tuple(base.meta(name).shape) == tuple(saved.shape)
                 and torch.equal(base.read(name).to(saved.dtype), saved))
        (same if equal else differ).add(name)
    return same, differ
