"""The two 4-bit checkpoint layouts vLLM loads, as data: tensor names, packing and ``quantization_config`` (the
nibble packing and the reading side live below the checkpoint reader, in ``convert.stored.int4``).

compressed-tensors ``pack-quantized`` (vLLM's preferred format):
  ``weight_packed`` int32 ``[out, in/8]`` (8 nibbles per int32, lowest bits first, value + 8),
  ``weight_scale [out, in/G]``, ``weight_shape`` int64 ``[2]``, and when asymmetric
  ``weight_zero_point`` int32 ``[out/8, in/G]`` (packed the same way along the output dim).
AutoAWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``):
  ``qweight`` int32 ``[in, out/8]``, ``qzeros`` int32 ``[in/G, out/8]``, ``scales`` fp16 ``[in/G, out]``;
  unsigned nibbles (value + 8) in the order [0, 2, 4, 6, 1, 3, 5, 7] inside each int32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..stored.int4 import AWQ_ORDER, PACK, pack_nibbles, quant_info, unpack_nibbles
from . import FORMAT_NAMES
from .quant import QuantizedWeight, QuantScheme


def _offset(scheme: QuantScheme) -> int:
    return -scheme.qmin  # signed -> unsigned nibble


# compressed-tensors pack-quantized

def ct_pack(qw: QuantizedWeight, prefix: str) -> dict[str, torch.Tensor]:
    off = _offset(qw.scheme)
    out = {f"{prefix}.weight_packed": pack_nibbles(qw.q.to(torch.int16) + off),
           f"{prefix}.weight_scale": qw.scale.contiguous(),
           f"{prefix}.weight_shape": torch.tensor(qw.shape, dtype=torch.int64)}
    if qw.zero is not None:
        out[f"{prefix}.weight_zero_point"] = pack_nibbles((qw.zero.to(torch.int16) + off).T.contiguous()).T.contiguous()
    return out


def ct_unpack(tensors: dict[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    off = _offset(scheme)
    out_f, in_f = (int(x) for x in tensors[f"{prefix}.weight_shape"].tolist())
    q = (unpack_nibbles(tensors[f"{prefix}.weight_packed"])[:, :in_f].to(torch.int16) - off).to(torch.int8)
    scale = tensors[f"{prefix}.weight_scale"]
    zero = None
    if f"{prefix}.weight_zero_point" in tensors:
        zp = unpack_nibbles(tensors[f"{prefix}.weight_zero_point"].T.contiguous()).T[:out_f]
        zero = (zp.to(torch.int16) - off).to(torch.int8).contiguous()
    return QuantizedWeight(q, scale, zero, scheme)


def ct_shapes(out_f: int, in_f: int, scheme: QuantScheme, prefix: str) -> dict[str, tuple[torch.dtype, tuple]]:
    groups = in_f // scheme.group_size
    shapes = {f"{prefix}.weight_packed": (torch.int32, (out_f, in_f // PACK)),
              f"{prefix}.weight_scale": (scheme.scale_dtype, (out_f, groups)),
              f"{prefix}.weight_shape": (torch.int64, (2,))}
    if not scheme.symmetric:
        shapes[f"{prefix}.weight_zero_point"] = (torch.int32, (out_f // PACK, groups))
    return shapes


def ct_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
                        "strategy": "group", "group_size": scheme.group_size, "dynamic": False,
                        "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


# AutoAWQ GEMM

def awq_pack(qw: QuantizedWeight, prefix: str) -> dict[str, torch.Tensor]:
    off = _offset(qw.scheme)
    zero = qw.zero if qw.zero is not None else torch.zeros_like(qw.scale, dtype=torch.int8)
    return {f"{prefix}.qweight": pack_nibbles((qw.q.to(torch.int16) + off).T.contiguous(), AWQ_ORDER),
            f"{prefix}.qzeros": pack_nibbles((zero.to(torch.int16) + off).T.contiguous(), AWQ_ORDER),
            f"{prefix}.scales": qw.scale.T.contiguous().to(torch.float16)}


def awq_unpack(tensors: dict[str, torch.Tensor], prefix: str, scheme: QuantScheme) -> QuantizedWeight:
    off = _offset(scheme)
    q = (unpack_nibbles(tensors[f"{prefix}.qweight"], AWQ_ORDER).T.to(torch.int16) - off).to(torch.int8)
    zero = (unpack_nibbles(tensors[f"{prefix}.qzeros"], AWQ_ORDER).T.to(torch.int16) - off).to(torch.int8)
    scale = tensors[f"{prefix}.scales"].T.contiguous()
    return QuantizedWeight(q.contiguous(), scale, None if scheme.symmetric else zero.contiguous(), scheme)


def awq_shapes(out_f: int, in_f: int, scheme: QuantScheme, prefix: str) -> dict[str, tuple[torch.dtype, tuple]]:
    groups = in_f // scheme.group_size
    return {f"{prefix}.qweight": (torch.int32, (in_f, out_f // PACK)),
            f"{prefix}.qzeros": (torch.int32, (groups, out_f // PACK)),
            f"{prefix}.scales": (torch.float16, (groups, out_f))}


def awq_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    return {"quant_method": "awq", "bits": scheme.bits, "group_size": scheme.group_size,
            "zero_point": True, "version": "gemm", "modules_to_not_convert": ignore or None}


@dataclass(frozen=True)
class AWQFormat:
    name: str  # --format
    summary: str
    pack: Callable[[QuantizedWeight, str], dict[str, torch.Tensor]]
    unpack: Callable[[dict[str, torch.Tensor], str, QuantScheme], QuantizedWeight]
    shapes: Callable[[int, int, QuantScheme, str], dict[str, tuple[torch.dtype, tuple]]]
    config: Callable[[QuantScheme, list[str]], dict]
    marker: str  # the tensor suffix that identifies a quantized module in a checkpoint
    scale_dtypes: tuple[torch.dtype, ...]  # model dtypes the format stores scales in


FORMATS: dict[str, AWQFormat] = {f.name: f for f in (
    AWQFormat("compressed-tensors", "compressed-tensors pack-quantized (vLLM's preferred format)",
              ct_pack, ct_unpack, ct_shapes, ct_config, "weight_packed", (torch.float16, torch.bfloat16)),
    AWQFormat("awq-gemm", "AutoAWQ GEMM (older vLLM, TGI, other engines)",
              awq_pack, awq_unpack, awq_shapes, awq_config, "qweight", (torch.float16,)),
)}
DEFAULT_FORMAT = "compressed-tensors"
assert tuple(FORMATS) == FORMAT_NAMES


def format_for(name: str) -> AWQFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UserError(f"unknown --format {name!r}", f"use one of {', '.join(FORMATS)}") from None


def scheme_of(quantization_config: dict) -> tuple[str, QuantScheme] | None:
    """(format name, scheme) of a checkpoint tuneport can decode, or None."""
    info = quant_info(quantization_config)
    if info is None:
        return None
    groups = list((quantization_config.get("config_groups") or {}).values())
    weights = (groups[0] if groups else {}).get("weights") or {}
    if weights.get("actorder") or weights.get("strategy", "group") != "group" or info["bits"] != 4:
        raise UserError(f"tuneport decodes group-wise 4-bit weights without activation ordering; this checkpoint "
                        f"has {info['bits']}-bit, strategy {weights.get('strategy')!r}, actorder "
                        f"{weights.get('actorder')!r}", "run it in vLLM")
    scale = torch.float16
    return info["format"], QuantScheme(info["bits"], info["group_size"], info["symmetric"], scale)
