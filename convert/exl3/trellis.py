"""The EXL3 trellis: 256 weights of a 16x16 tile as 256 K-bit symbols in a tail-biting shift register.

Facts (exllamav3's pack and reconstruct kernels):
- A linear's ``trellis`` is int16 ``[in/16, out/16, 16*K]``: tile (ti, tj) covers rows 16ti.. (inputs) and
  columns 16tj.. (outputs) of W_hat [in, out]; K = bits per weight = ``shape[-1] / 16``, an integer 1..8 or
  (exllamav3 1.6, mul1 only) a half-integer: position p then adds D(p) = int(K) + 1 bits when p is odd, else
  int(K) (mask 0xAAAA over each 16 positions).
- Position p (0..255) of a tile's sequence holds the element at row r, column c of the tile, with t = p // 8,
  j = p % 8: r = 2(t % 4) + (j & 1) + 8((j >> 1) & 1), c = t // 4 + 8(j >> 2) (the tensor-core fragment order).
- Each position has a D-bit symbol (D = K for integer K); its 16-bit state is the last 16 bits of the symbol
  stream up to and including it: state[p] = ((state[p-1] << D) | sym[p]) & 0xFFFF, positions taken mod 256
  (tail-biting, so state[0] >> D == state[255] & (2^(16-D) - 1)).
- The 256 symbols are concatenated most significant bit first into a 256K-bit stream, cut into 32-bit words
  each stored little-endian: the int16 row read as int32 words gives the stream's words in order.
"""

from __future__ import annotations

from functools import cache

import torch

from . import HALF_RATES
from .codebook import lookup_table

TILE = 16
POSITIONS = TILE * TILE
K_RANGE = range(1, 9)
HALF_MASK = 0xAAAA  # half-integer K = KA + 0.5: positions with an odd index in each 16 take KA + 1 bits
Bits = int | float  # K: 1..8, or one of HALF_RATES


@cache
def fragment_order() -> torch.Tensor:
    """perm[p] = r*16 + c: the row-major index in its tile of trellis position p."""
    p = torch.arange(POSITIONS)
    t, j = p // 8, p % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * (j >> 2)
    return r * TILE + c


def bits_from_width(width: int) -> Bits:
    """K from a trellis row of ``width`` int16 values (16*K), or ValueError."""
    k = width / TILE
    if k.is_integer() and int(k) in K_RANGE:
        return int(k)
    if k in HALF_RATES:
        return k
    raise ValueError(f"a trellis row holds 16*K int16 values for K in 1..8, 1.5, 2.5 or 3.5, not {width}")


def bits_of(trellis: torch.Tensor) -> Bits:
    """K, the bits per weight of a trellis tensor."""
    return bits_from_width(trellis.shape[-1])


@cache
def _layout(k: Bits) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, the bits each position adds; S = cumsum D, the stream bit where each position's window ends)."""
    step = torch.full((POSITIONS,), int(k), dtype=torch.long)
    if k != int(k):
        step += (HALF_MASK >> (torch.arange(POSITIONS) % TILE)) & 1
    return step, torch.cumsum(step, 0)


def pack(states: torch.Tensor, k: Bits) -> torch.Tensor:
    """int16 [..., 16K] from the states [..., 256] of tiles (only each state's low D bits, its symbol, are kept)."""
    step, end = _layout(k)
    total = int(end[-1])
    bit = torch.arange(total)
    owner = torch.searchsorted(end, bit, right=True)  # the position each stream bit belongs to
    shift = end[owner] - 1 - bit  # most significant bit first
    stream = (states.to(torch.int64)[..., owner] >> shift) & 1
    words = stream.reshape(*states.shape[:-1], total // 32, 32) << torch.arange(31, -1, -1)
    return words.sum(-1).to(torch.int32).contiguous().view(torch.int16)  # int32 wraps keep the bit pattern


def unpack(trellis: torch.Tensor) -> torch.Tensor:
    """The 16-bit states (int64 [..., 256]) of every tile of ``trellis`` [..., 16K]: position p's state is the
    16 stream bits ending where its symbol ends, read around the ring."""
    _, end = _layout(bits_of(trellis))
    u = trellis.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [..., 8K] stream words
    n_words = u.shape[-1]
    start = (end - 16) % (32 * n_words)
    first, offset = start // 32, start % 32
    pair = (u[..., first] << 32) | u[..., (first + 1) % n_words]
    return (pair >> (48 - offset)) & 0xFFFF


def states_from_symbols(symbols: torch.Tensor, k: Bits) -> torch.Tensor:
    """The tail-biting states [..., 256] of a tile's symbols [..., 256] (each D bits wide)."""
    step, end = _layout(k)
    ring = int(end[-1])
    symbols = symbols.to(torch.int64) & ((1 << step) - 1)
    states = torch.zeros_like(symbols)
    for s in range(TILE):  # symbol p-s sits (end[p] - end[p-s]) bits above symbol p, while that is < 16
        shift = (end - torch.roll(end, s)) % ring
        states |= torch.where(shift < 16, torch.roll(symbols, s, dims=-1) << shift.clamp(max=15), 0)
    return states & 0xFFFF


def tail_biting(states: torch.Tensor, k: Bits) -> torch.Tensor:
    """Whether each tile's states [..., 256] form one tail-biting shift register: each state is the previous
    one shifted by its D bits, around the ring."""
    step, _ = _layout(k)
    keep = (1 << (TILE - step)) - 1
    return ((states >> step) == (torch.roll(states, 1, dims=-1) & keep)).all(-1)


def tiles_to_matrix(values: torch.Tensor) -> torch.Tensor:
    """[tk, tn, 256] values in fragment order -> the [16tk, 16tn] matrix they tile."""
    tk, tn, _ = values.shape
    rowmajor = torch.empty_like(values)
    rowmajor[..., fragment_order()] = values
    return rowmajor.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def matrix_to_tiles(w: torch.Tensor) -> torch.Tensor:
    """The inverse of ``tiles_to_matrix``: [k, n] -> [k/16, n/16, 256] in fragment order."""
    k, n = w.shape
    tiles = w.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n // TILE, POSITIONS)
    return tiles[..., fragment_order()]


def decode(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """W_hat [in, out] (fp16) of a trellis tensor [in/16, out/16, 16K] under ``codebook``."""
    return tiles_to_matrix(lookup_table(codebook)[unpack(trellis)])
