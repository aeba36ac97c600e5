"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts: ``<name>_blocks`` uint8
``[..., G, 16]`` (32 E2M1 values per block, two per byte, the low nibble first) and ``<name>_scales`` uint8
``[..., G]`` (one E8M0 exponent per block, biased by 127). A row of ``G`` blocks decodes to ``32 G`` values."""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
ROWS_PER_CHUNK = 1 << 16  # blocks decoded at once: the work space stays small for any expert tensor


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``decode`` gives for blocks of shape ``[..., G, 16]``: ``[..., 32 G]``."""
    *prefix, groups, width = blocks_shape
    return (*prefix, groups * width * 2)


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of MXFP4 ``blocks`` with their ``scales``, ``[..., 32 G]`` in ``dtype`` (exact: every E2M1 value
    times a power of two is representable in float32 and bfloat16 within their exponent range)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not fit scales {list(scales.shape)}")
    *prefix, groups, width = blocks.shape
    flat = blocks.reshape(-1, width).to(torch.uint8)
    exps = scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    lut = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(flat.shape[0], width * 2, dtype=dtype)
    for r0 in range(0, flat.shape[0], ROWS_PER_CHUNK):
        blk, part = flat[r0:r0 + ROWS_PER_CHUNK], torch.empty(min(ROWS_PER_CHUNK, flat.shape[0] - r0), width * 2)
        part[:, 0::2] = lut[(blk & 0x0F).long()]
        part[:, 1::2] = lut[(blk >> 4).long()]
        out[r0:r0 + len(blk)] = torch.ldexp(part, exps[r0:r0 + len(blk)]).to(dtype)
    return out.reshape(*prefix, groups * width * 2)


def encode(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [..., 32 G]`` as MXFP4 ``(blocks [..., G, 16], scales [..., G])``: each block's scale the power of
    two that puts its largest magnitude in [4, 8) (as ggml's reference quantizer picks it), each value the nearest
    E2M1 code (clipped at ±6). ``decode`` of the result is what a checkpoint stored this way holds."""
    *prefix, n = values.shape
    if n % 32:
        raise ValueError(f"MXFP4 packs rows of a multiple of 32 values, not {n}")
    x = values.float().reshape(-1, n // 32, 32)
    amax = x.abs().amax(-1)
    exps = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2, torch.zeros_like(amax))
    exps = exps.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = x / torch.ldexp(torch.ones_like(amax), exps.int())[..., None]
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # the first of equals: +0 before -0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return (blocks.reshape(*prefix, n // 32, 16).contiguous(),
            (exps + SCALE_BIAS).to(torch.uint8).reshape(*prefix, n // 32).contiguous())
