"""4-bit integer weights packed 8 to an int32, in the two layouts vLLM loads (the layouts' full description and
their writers: ``convert.awq.formats``): reading a checkpoint's ``quantization_config`` and its modules' shapes,
and packing or unpacking the nibbles.

compressed-tensors ``pack-quantized``: ``weight_packed`` int32 ``[out, in/8]`` (lowest bits first),
``weight_shape`` int64 ``[2]``; AutoAWQ GEMM: ``qweight`` int32 ``[in, out/8]`` in the nibble order
``AWQ_ORDER``, ``scales`` ``[in/G, out]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where nibbles are packed, so reading a checkpoint's config stays light
    import torch

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of an int32 holds column AWQ_ORDER[i]


PACK_ROWS = 1024  # rows packed at once: the int64 work space stays small for any weight


def pack_nibbles(u: torch.Tensor, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """Unsigned 4-bit values ``[rows, cols]`` (cols % 8 == 0) -> int32 ``[rows, cols/8]``."""
    import torch

    if len(u) > PACK_ROWS:
        return torch.cat([_pack_rows(u[i:i + PACK_ROWS], order) for i in range(0, len(u), PACK_ROWS)])
    return _pack_rows(u, order)


def _pack_rows(u: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    import torch

    rows, cols = u.shape
    v = u.to(torch.int64).reshape(rows, cols // PACK, PACK)
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64)
    for slot, col in enumerate(order):
        packed |= (v[:, :, col] & 0xF) << (4 * slot)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_nibbles(p: torch.Tensor, order: tuple[int, ...] = tuple(range(PACK))) -> torch.Tensor:
    """int32 ``[rows, n]`` -> unsigned 4-bit values ``[rows, n·8]`` (int8)."""
    import torch

    rows, n = p.shape
    v = p.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, n, PACK, dtype=torch.int8)
    for slot, col in enumerate(order):
        out[:, :, col] = ((v >> (4 * slot)) & 0xF).to(torch.int8)
    return out.reshape(rows, n * PACK)


def quant_info(quantization_config: dict) -> dict | None:
    """``{format, bits, group_size, symmetric}`` of a checkpoint in one of the two layouts, else None."""
    method = quantization_config.get("quant_method")
    if method == "awq" and str(quantization_config.get("version", "gemm")).lower() == "gemm":
        return {"format": "awq-gemm", "bits": int(quantization_config.get("bits", 4)),
                "group_size": int(quantization_config.get("group_size", 128)),
                "symmetric": not quantization_config.get("zero_point", True)}
    if method == "compressed-tensors" and quantization_config.get("format") == "pack-quantized":
        groups = list((quantization_config.get("config_groups") or {}).values())
        w = (groups[0] if groups else {}).get("weights") or {}
        return {"format": "compressed-tensors", "bits": int(w.get("num_bits", 4)),
                "group_size": int(w.get("group_size") or 0), "symmetric": bool(w.get("symmetric", True))}
    return None


def packed_weight_shape(ckpt, module: str) -> tuple[int, int] | None:
    """``[out, in]`` of ``module`` in a 4-bit checkpoint (either format), from its packed tensors."""
    if f"{module}.weight_shape" in ckpt:
        out_f, in_f = (int(x) for x in ckpt.read(f"{module}.weight_shape").tolist())
        return out_f, in_f
    if f"{module}.qweight" in ckpt and f"{module}.scales" in ckpt:
        return ckpt.meta(f"{module}.scales").shape[1], ckpt.meta(f"{module}.qweight").shape[0]
    return None
