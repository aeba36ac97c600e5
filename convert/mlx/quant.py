"""mlx-lm's quantizers as a table, and the per-tensor quantizer (``mlx.core.quantize``).

What ``mlx_lm.convert`` does, tensor by tensor: every Linear and Embedding weight whose last dimension
is a multiple of the group size becomes ``weight`` (uint32-packed), ``scales`` and (affine only)
``biases``; the config records ``quantization`` = {group_size, bits, mode} (and per-module entries for
the mixed recipes, which give some modules more bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError
from . import DEFAULT_GROUP_SIZE, GROUP_SIZES, QUANT_NAMES


@dataclass(frozen=True)
class MlxQuant:
    name: str
    mode: str  # mlx.core.quantize mode: affine, mxfp4, nvfp4, mxfp8
    bits: int
    fixed_group: int | None = None  # the group size a microscaling mode prescribes
    mixed: tuple[int, int] | None = None  # (low, high) bits of a mixed recipe (mlx-lm's --quant-predicate)
    summary: str = ""

    @property
    def affine(self) -> bool:
        return self.mode == "affine"


QUANT_TYPES: dict[str, MlxQuant] = {q.name: q for q in (
    *(MlxQuant(f"q{b}", "affine", b, summary=f"{b}-bit affine (scale + bias per group)") for b in (2, 3, 4, 5, 6, 8)),
    MlxQuant("mxfp4", "mxfp4", 4, 32, summary="4-bit float, 8-bit power-of-two scale per 32"),
    MlxQuant("nvfp4", "nvfp4", 4, 16, summary="4-bit float, fp8 scale per 16"),
    MlxQuant("mxfp8", "mxfp8", 8, 32, summary="8-bit float, 8-bit power-of-two scale per 32"),
    *(MlxQuant(f"mixed_{lo}_{hi}", "affine", lo, mixed=(lo, hi),
               summary=f"{lo}-bit affine, {hi}-bit for v_proj/down_proj of some layers and lm_head")
      for lo, hi in ((2, 6), (3, 4), (3, 6), (4, 6))),
)}
assert tuple(QUANT_TYPES) == QUANT_NAMES


def quant_type(name: str) -> MlxQuant:
    if "," in name:
        raise UserError(f"--quant {name}: --target mlx writes one model per export",
                        "export once per type (each into its own --out)")
    try:
        return QUANT_TYPES[name.lower()]
    except KeyError:
        raise UserError(f"--quant {name!r} is not an mlx-lm quantization",
                        f"use one of {', '.join(QUANT_TYPES)}") from None


def group_size_for(q: MlxQuant, group_size: int | None) -> int:
    if q.fixed_group is not None:
        if group_size not in (None, q.fixed_group):
            raise UserError(f"--group-size {group_size}: {q.name} always uses groups of {q.fixed_group}",
                            "drop --group-size")
        return q.fixed_group
    if group_size is None:
        return DEFAULT_GROUP_SIZE
    if group_size not in GROUP_SIZES:
        raise UserError(f"--group-size {group_size} is not one mlx quantizes with",
                        f"use {', '.join(map(str, GROUP_SIZES))}")
    return group_size


@dataclass(frozen=True)
class QuantPlan:
    """One export's quantization: the type, its group size, and the model's layer count (mixed recipes)."""

    q: MlxQuant
    group_size: int
    n_layers: int
    layer_prefix: str = "model.layers"
    predicate: Callable[[str], dict | None] | None = None  # MlxArch.quant_predicate (mixed recipes override it)

    def defaults(self) -> dict:
        return {"group_size": self.group_size, "bits": 4 if self.q.mixed else self.q.bits, "mode": self.q.mode}

    def params(self, module: str, shape: tuple[int, ...]) -> dict | None:
        """How ``module`` (weight ``shape``: a Linear's, or ``[E, out, in]`` of stacked experts) is quantized,
        or None when it stays as it is."""
        if len(shape) not in (2, 3) or shape[-1] % self.group_size:
            return None
        if self.q.mixed is None:
            if self.predicate is not None and (own := self.predicate(module)) is not None:
                return {"mode": "affine", **own}  # the model's own choice (mlx-lm passes it to to_quantized)
            return self.defaults()
        return {"group_size": self.group_size, "bits": self._mixed_bits(module), "mode": "affine"}

    def recorded(self, module: str, params: dict) -> dict | None:
        """The per-module entry mlx-lm writes into ``quantization`` for ``module`` (None: none)."""
        if self.q.mixed is not None:
            return params
        if self.predicate is not None and (own := self.predicate(module)) is not None:
            return dict(own)
        return None

    def _mixed_bits(self, module: str) -> int:
        """mlx-lm's mixed recipe (after llama.cpp's Q4_K_M): more bits for v_proj and down_proj of the
        first and last eighth of the layers and every third layer between, and for lm_head."""
        low, high = self.q.mixed
        n = self.n_layers
        parts = module.split(".")
        depth = len(self.layer_prefix.split("."))
        index = int(parts[depth]) if len(parts) > depth and parts[depth].isdigit() else 0
        more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
        if more and any(k in module for k in ("v_proj", "v_a_proj", "v_b_proj", "down_proj")):
            return high
        return high if "lm_head" in module else low

    def config(self, per_module: dict[str, dict]) -> dict:
        """``quantization`` as mlx-lm writes it: the defaults and the ``recorded`` per-module entries."""
        out = self.defaults()
        out.update({m: e for m, p in per_module.items() if (e := self.recorded(m, p)) is not None})
        return out


def quantized_shapes(shape: tuple[int, ...], params: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Suffix -> (shape, "packed" | "scale" | "float") of what ``mx.quantize`` returns for a weight (groups run
    along the last axis; stacked experts keep their leading axis)."""
    *lead, cols = shape
    groups = cols // params["group_size"]
    out = {"weight": ((*lead, cols * params["bits"] // 32), "packed"),
           "scales": ((*lead, groups), "float" if params["mode"] == "affine" else "scale")}
    if params["mode"] == "affine":
        out["biases"] = ((*lead, groups), "float")
    return out


def quantize(w, params: dict) -> dict:
    """``{"weight", "scales"[, "biases"]}``: ``mx.quantize`` of an mlx array, exactly as mlx-lm calls it."""
    import mlx.core as mx

    parts = mx.quantize(w, group_size=params["group_size"], bits=params["bits"], mode=params["mode"])
    return dict(zip(("weight", "scales", "biases"), parts, strict=False))
