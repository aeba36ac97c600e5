"""EXL3 codebooks: a 16-bit trellis state to an fp16 weight (before the Hadamard rotations and scales).

Three codebooks, told apart per linear by a marker tensor (``<key>.mcg`` or ``<key>.mul1``; none: 3INST) that holds
the codebook's multiplier (below) as a 0-dim int32 of the same bits:
- ``3inst``: x = state*89226354 + 64248484 (mod 2^32); x = (x & 0x8FFF8FFF) ^ 0x3B603B60; the sum of the
  two fp16 numbers in x's low and high halves.
- ``mcg``: the same with x = state*0xCBAC1FED.
- ``mul1``: x = state*0x83DCD12D; s = the sum of x's four bytes; fp16(fma(1024 + s, 0.00676727294921875,
  -10.3828125)).
No scale is applied after the codebook: exllamav3 folds every scale into ``suh``/``svh``.

The marker's value (exllamav3's history): 0.0.3-0.0.8 took the multiplier from the user (``--mcg_multiplier``,
"experimental") and its kernels used the value stored; since 0.0.9 (commit 0f2da5d) the multipliers are fixed
to these two and written as ``torch.tensor(mult, dtype=torch.uint32).view(torch.int)``. No version writes 0: the
early ones stored a marker only for a non-zero multiplier, and ``conversion/quant_config.py`` drops a 0 marker
from ``quantization_config.json``. So a marker holding anything but its codebook's multiplier, 0 included, is a
codebook tuneport does not decode.
"""

from __future__ import annotations

from functools import cache

import torch

from . import CODEBOOKS

MULTIPLIERS = {"3inst": 89226354, "mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
INST3_ADD = 64248484
INST_MASK, INST_XOR = 0x8FFF8FFF, 0x3B603B60
MUL1_SCALE, MUL1_BIAS = 0.00676727294921875, -10.3828125  # fp16 0x1EEE and 0xC931: exact in fp32
U32 = 0xFFFFFFFF


def _halves_as_fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 16 bits of uint32 values (held in int64) read as fp16 numbers."""
    def half(bits: torch.Tensor) -> torch.Tensor:
        return bits.to(torch.int32).to(torch.int16).view(torch.float16)  # int16 wraps: the bit pattern is kept

    return half(x & 0xFFFF), half(x >> 16)


def codebook_values(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """fp16 weights for 16-bit ``states`` (any integer tensor) under ``codebook``, by the formulas above."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    x = states.to(torch.int64) & 0xFFFF
    if codebook == "mul1":
        x = (x * MULTIPLIERS["mul1"]) & U32
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        return ((1024 + byte_sum).float() * MUL1_SCALE + MUL1_BIAS).half()  # one rounding, as fp16 fma
    x = x * MULTIPLIERS[codebook] + (INST3_ADD if codebook == "3inst" else 0)
    x = ((x & U32) & INST_MASK) ^ INST_XOR
    lo, hi = _halves_as_fp16(x)
    return (lo.float() + hi.float()).half()  # an fp16 add: exact in fp32, then one rounding


@cache
def lookup_table(codebook: str) -> torch.Tensor:
    """All 65536 states' fp16 values under ``codebook`` (decode with ``lookup_table(cb)[states]``)."""
    return codebook_values(torch.arange(1 << 16), codebook)


def marker_problem(codebook: str, marker: torch.Tensor) -> str | None:
    """Why ``marker`` (the ``<key>.<codebook>`` tensor) is not the one exllamav3 writes for ``codebook``, or None."""
    if marker.numel() != 1 or marker.dtype not in (torch.int32, torch.uint32):
        return f"is {str(marker.dtype).removeprefix('torch.')} of shape {list(marker.shape)}, not a 0-dim int32"
    value = int(marker.reshape(()).view(torch.int32)) & U32
    if value != MULTIPLIERS[codebook]:
        return f"holds {value:#010x}, not the {codebook} multiplier {MULTIPLIERS[codebook]:#010x}"
    return None


def codebook_of(tensor_names: set[str] | list[str], key: str) -> str:
    """The codebook of the linear ``key`` from the marker tensors stored beside it."""
    names = set(tensor_names)
    for codebook in ("mcg", "mul1"):  # the marker tensor is named after its codebook; kernels look for mcg first
        if f"{key}.{codebook}" in names:
            return codebook
    return "3inst"
