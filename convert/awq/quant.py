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


def _stored(scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The scale as stored (16-bit), never 0: an all-zero group keeps a tiny scale and decodes to zeros."""
    return scale.to(scheme.scale_dtype).clamp(min=torch.finfo(scheme.scale_dtype).tiny)


def _qparams(g: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group scale (rounded to the scale dtype, as stored) and zero point (float, integer-valued)."""
    lo, hi = torch.aminmax(g, dim=-1)
    if scheme.symmetric:
        amax = torch.maximum(-lo, hi)
        return _stored(amax / scheme.qmax, scheme), None
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = _stored((hi - lo) / (scheme.qmax - scheme.qmin), scheme)
    zero = torch.clamp(scheme.qmin - torch.round(lo / scale.float()), scheme.qmin, scheme.qmax)
    return scale, zero


def _levels(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """The integer levels (as float) of grouped weights ``g``: round(g / scale) + zero, clamped; a new tensor."""
    q = g / scale.float().unsqueeze(-1)
    q.round_()
    if zero is not None:
        q.add_(zero.unsqueeze(-1))
    return q.clamp_(scheme.qmin, scheme.qmax)


def quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest group quantization of ``w`` (already scaled and clipped by AWQ)."""
    g = _grouped(w.float(), scheme.group_size)
    scale, zero = _qparams(g, scheme)
    q = _levels(g, scale, zero, scheme)
    return QuantizedWeight(q.reshape(w.shape).to(torch.int8), scale,
                           None if zero is None else zero.to(torch.int8), scheme)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) · scale`` per group, computed in fp32 and cast to ``dtype``."""
    g = _grouped(qw.q.float(), qw.scheme.group_size)
    if qw.zero is not None:
        g.sub_(qw.zero.float().unsqueeze(-1))
    return g.mul_(qw.scale.float().unsqueeze(-1)).reshape(qw.q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The fp32 weights the 4-bit checkpoint of ``w`` decodes to (``dequantize(quantize(w))``, with one
    full-size temporary instead of several)."""
    g = _grouped(w.float(), scheme.group_size)
    scale, zero = _qparams(g, scheme)
    q = _levels(g, scale, zero, scheme)
    if zero is not None:
        q.sub_(zero.unsqueeze(-1))
    return q.mul_(scale.float().unsqueeze(-1)).reshape(w.shape)
