"""Group-wise integer weight quantization: the numbers every AWQ format stores.

A weight ``W [out, in]`` is cut into groups of ``group_size`` input columns; each (row, group) has a
scale (stored in the model's 16-bit dtype) and, when asymmetric, an integer zero point. Integers are
kept signed in ``[-2^(b-1), 2^(b-1) - 1]`` as compressed-tensors does; ``dequantize`` gives exactly the
weights the engines compute with, and ``fake_quantize`` gives the same numbers without keeping the ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from . import GROUP_SIZES


@dataclass(frozen=True)
class QuantScheme:
    """``bits``-bit integers, groups of ``group_size`` input columns, with or without zero points."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise UserError(f"AWQ writes 4-bit weights, not {self.bits}-bit", "drop the bits setting")
        if self.group_size not in GROUP_SIZES:
            raise UserError(f"unsupported --group-size {self.group_size}",
                            f"use one of {', '.join(map(str, GROUP_SIZES))}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def fits(self, in_features: int) -> bool:
        return in_features % self.group_size == 0


@dataclass
class QuantizedWeight:
    """``q`` int8 ``[out, in]`` in ``[qmin, qmax]``, ``scale [out, in/G]`` (16-bit), ``zero`` int8
    ``[out, in/G]`` (None when symmetric)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    scheme: QuantScheme

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, inp = w.shape
    return w.reshape(out, inp // group_size, group_size)


def quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest group quantization of ``w`` (already scaled and clipped by AWQ)."""
    g = _grouped(w.float(), scheme.group_size)
    if scheme.symmetric:
        amax = g.abs().amax(dim=-1)
        scale = (amax / scheme.qmax).clamp(min=1e-8).to(scheme.scale_dtype)
        s = scale.float().unsqueeze(-1)
        q = torch.clamp(torch.round(g / s), scheme.qmin, scheme.qmax)
        zero = None
    else:
        lo = g.amin(dim=-1).clamp(max=0)
        hi = g.amax(dim=-1).clamp(min=0)
        levels = scheme.qmax - scheme.qmin
        scale = ((hi - lo) / levels).clamp(min=1e-8).to(scheme.scale_dtype)
        s = scale.float()
        zero_f = torch.clamp(scheme.qmin - torch.round(lo / s), scheme.qmin, scheme.qmax)
        q = torch.clamp(torch.round(g / s.unsqueeze(-1)) + zero_f.unsqueeze(-1), scheme.qmin, scheme.qmax)
        zero = zero_f.to(torch.int8)
    return QuantizedWeight(q.reshape(w.shape).to(torch.int8), scale, zero, scheme)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) · scale`` per group, computed in fp32 and cast to ``dtype``."""
    g = _grouped(qw.q.float(), qw.scheme.group_size)
    if qw.zero is not None:
        g = g - qw.zero.float().unsqueeze(-1)
    return (g * qw.scale.float().unsqueeze(-1)).reshape(qw.q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The fp32 weights the 4-bit checkpoint of ``w`` decodes to."""
    return dequantize(quantize(w, scheme))
