"""Recognising MLX LM directories and mlx-lm adapters without importing mlx (``inspect``, serve, verify)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from . import ADAPTER_CONFIG, ADAPTER_WEIGHTS


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
    files = sorted(path.glob("model*.safetensors"))
    quant = cfg.get("quantization")
    if not files or not (quant or _st_format(files[0]) == "mlx"):
        return None
    if not isinstance(quant, dict):
        return {"quantization": None, "per_module": 0}
    per_module = {k: v for k, v in quant.items() if isinstance(v, dict)}
    top = {k: quant.get(k) for k in ("mode", "bits", "group_size")}
    top["mode"] = top["mode"] or "affine"
    return {"quantization": top, "per_module": len(per_module),
            "bits_used": sorted({v.get("bits") for v in per_module.values()} | {top["bits"]})}
