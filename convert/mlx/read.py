"""Recognising MLX LM directories and mlx-lm adapters without importing mlx (``inspect``, serve, verify)."""

from __future__ import annotations

import json
import re
import struct
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..stored.mlx import module_quant
from . import ADAPTER_CONFIG, ADAPTER_PARTS, ADAPTER_WEIGHTS
from .archs import MLX_ARCHS, mlx_config

if TYPE_CHECKING:
    from ..tensors import TensorMeta


def _st_format(path: Path) -> str | None:
    """The ``__metadata__.format`` of a safetensors file ("mlx" for files mlx wrote)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return None
            return (json.loads(f.read(n)).get("__metadata__") or {}).get("format")
    except (OSError, ValueError, struct.error):
        return None


def is_mlx_adapter(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_WEIGHTS).exists() and (path / ADAPTER_CONFIG).exists()


def mlx_model_info(path: Path) -> dict | None:
    """{quantization: {mode, bits, group_size} | None, per_module: n} for an MLX LM model directory
    (safetensors written by mlx, or an mlx-lm ``quantization`` config), else None."""
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.exists():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None  # not a model directory of any kind: Checkpoint says why
    files = sorted(path.glob("model*.safetensors"))
    quant = cfg.get("quantization")
    if not files or not (quant or _st_format(files[0]) == "mlx"):
        return None
    if not isinstance(quant, dict):
        return {"quantization": None, "per_module": 0}
    per_module = {k: v for k, v in quant.items() if isinstance(v, dict)}
    top = {k: quant.get(k) for k in ("mode", "bits", "group_size")}
    top["mode"] = top["mode"] or "affine"
    used = {v.get("bits") for v in per_module.values()} if per_module else {top["bits"]}  # mixed: per module
    return {"quantization": top, "per_module": len(per_module), "bits_used": sorted(used)}


def _bad_mlx(path: Path, what: str) -> UserError:
    return UserError(f"{path} is not a valid MLX LM directory ({what})",
                     "export it again (tuneport export --target mlx) or copy the whole directory again")


def mlx_weights(path: Path, metas: dict[str, TensorMeta], quant: dict | None) -> dict:
    """What an MLX LM directory's tensors hold (``metas``: name -> TensorMeta of every weight file; ``quant``:
    its config's ``quantization``): parameters with quantized weights counted unpacked, the floating dtype,
    and per bit width how many modules are quantized with it. A packed weight whose scales disagree with
    its bits and group size is a UserError naming the module."""
    quantized = sorted(n.removesuffix(".scales") for n in metas
                       if n.endswith(".scales") and f"{n.removesuffix('.scales')}.weight" in metas)
    parts = {f"{m}.{s}" for m in quantized for s in ("scales", "biases")}
    params, by_bits = 0, Counter()
    for m in quantized:
        q = module_quant(quant or {}, m)
        rows, packed = metas[f"{m}.weight"].shape[0], metas[f"{m}.weight"].shape[-1]
        groups = metas[f"{m}.scales"].shape[-1]
        if not isinstance(q["bits"], int) or not isinstance(q["group_size"], int) or q["bits"] <= 0 or \
                packed * 32 != groups * q["group_size"] * q["bits"]:
            raise _bad_mlx(path, f"{m}: packed weight {list(metas[f'{m}.weight'].shape)} and scales "
                                 f"{list(metas[f'{m}.scales'].shape)} do not fit {q['bits']} bits in groups of "
                                 f"{q['group_size']}")
        params += rows * packed * 32 // q["bits"]
        by_bits[q["bits"]] += 1
    if quantized and not quant:
        raise _bad_mlx(path, f"{quantized[0]} is quantized but config.json has no quantization")
    floating = Counter()
    for name, meta in metas.items():
        if name in parts or name.removesuffix(".weight") in quantized:
            continue
        params += meta.numel
        if meta.dtype.is_floating_point:
            floating[meta.dtype] += meta.numel
    dtype = floating.most_common(1)[0][0] if floating else None
    return {"parameters": params, "dtype": str(dtype).replace("torch.", "") if dtype else None,
            "quantized_modules": len(quantized), "modules_by_bits": {b: by_bits[b] for b in sorted(by_bits)},
            "unquantized_matrices": sorted(n.removesuffix(".weight") for n, t in metas.items()
                                           if n.endswith(".weight") and len(t.shape) == 2
                                           and n.removesuffix(".weight") not in quantized)}


def hf_engines_refusal(info: dict, model_type: str | None) -> str | None:
    """Why transformers and vLLM would not run an MLX LM directory as mlx-lm does (None when they read it as is:
    unquantized, the Hugging Face tensor names of an architecture tuneport writes unchanged)."""
    if info["quantization"] is not None:
        return "its weights are in mlx's own quantization (packed weight, scales, biases), which only mlx reads"
    arch = MLX_ARCHS.get(str(model_type))
    if arch is None:
        return f"tuneport's MLX tables do not know architecture {model_type!r}, so its tensor layout is not checked"
    if arch.embed_factor is not None:
        return "its embedding rows are scaled for mlx-lm's model (see convert/mlx/archs.py), so they would run off"
    return None


def mlx_lm_refusal(cfg: dict) -> str | None:
    """Why mlx-lm would not run a Hugging Face directory as transformers does (None when it would): config
    keys it reads only at the top level, or a model that computes differently in mlx-lm."""
    arch = MLX_ARCHS.get(str(cfg.get("model_type")))
    if arch is None:
        return f"tuneport's MLX tables do not know architecture {cfg.get('model_type')!r}"
    try:
        _, filled = mlx_config(cfg)
    except UserError as e:
        return e.message
    if filled:
        return f"mlx-lm reads {', '.join(filled)} only at the top level of config.json, where this one lacks it"
    if arch.embed_factor is not None:
        return "mlx-lm computes its embedding scale differently (see convert/mlx/archs.py)"
    return None


def json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not valid JSON ({str(e)[:80]})", "repair it, or export the adapter again") from e
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object", "repair it, or export the adapter again")
    return data


def read_mlx_adapter(path: Path) -> dict:
    """The config of an mlx-lm adapter directory; a UserError if it is not one."""
    cfg_path = path / ADAPTER_CONFIG
    if not (path / ADAPTER_WEIGHTS).exists() or not cfg_path.exists():
        raise UserError(f"{path} is not an mlx-lm adapter", f"it needs {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}")
    cfg = json_object(cfg_path)
    if "lora_parameters" not in cfg and cfg.get("fine_tune_type", "lora") != "full":
        raise UserError(f"{cfg_path} has no lora_parameters", "it is not an mlx-lm adapter config")
    return cfg


def mlx_adapter_modules(path: Path) -> dict[str, dict]:
    """An mlx-lm adapter's tensors as {module path: {"lora_a", "lora_b"[, "m"]: fp32 numpy array}}; a
    UserError for a tensor that is not one of them or a module without both LoRA matrices."""
    from ..safetensors_file import SafetensorsFile

    st = SafetensorsFile(path / ADAPTER_WEIGHTS)
    modules: dict[str, dict] = {}
    for name in st.tensors:
        module, _, part = name.rpartition(".")
        if part not in ADAPTER_PARTS:
            raise UserError(f"{path / ADAPTER_WEIGHTS} holds {name}, which is not a LoRA tensor",
                            "an mlx-lm LoRA adapter holds lora_a, lora_b (and m for DoRA) per module")
        modules.setdefault(module, {})[part] = st.read(name).float().numpy()
    for module, parts in modules.items():
        if "lora_a" not in parts or "lora_b" not in parts:
            raise UserError(f"{path / ADAPTER_WEIGHTS}: {module} lacks lora_a or lora_b", "re-export the adapter")
    return modules


def mlx_adapter_info(path: Path) -> dict:
    """An mlx-lm adapter directory: its config (``read_mlx_adapter``) and its tensors (count, bytes, dtype,
    rank, layers); a UserError when the config or the tensors are not an mlx-lm adapter's."""
    from ..safetensors_file import SafetensorsFile

    cfg = read_mlx_adapter(path)
    st = SafetensorsFile(path / ADAPTER_WEIGHTS)
    lora = cfg.get("lora_parameters") or {}
    ranks = sorted({t.shape[-1] for n, t in st.tensors.items() if n.endswith(".lora_a") and len(t.shape) == 2})
    if lora.get("rank") is not None and ranks and ranks != [lora["rank"]]:
        raise UserError(f"{path / ADAPTER_WEIGHTS} has lora_a of rank {', '.join(map(str, ranks))}, "
                        f"{ADAPTER_CONFIG} says rank {lora['rank']}", "export the adapter again")
    modules = {n.rsplit(".", 1)[0] for n in st.tensors if n.rpartition(".")[2] in ADAPTER_PARTS}
    layers = sorted({int(m[1]) for n in modules if (m := re.search(r"\.layers\.(\d+)\.", n))})
    dtypes = Counter(str(t.dtype).replace("torch.", "") for t in st.tensors.values())
    return {"fine_tune_type": cfg.get("fine_tune_type", "lora"), "num_layers": cfg.get("num_layers"),
            "rank": lora.get("rank"), "scale": lora.get("scale"), "dropout": lora.get("dropout"),
            "keys": lora.get("keys"), "tensors": len(st.tensors), "bytes": st.size,
            "parameters": sum(t.numel for t in st.tensors.values()), "dtype": dtypes.most_common(1)[0][0]
            if dtypes else None, "modules": len(modules), "layers": [layers[0], layers[-1]] if layers else None}
