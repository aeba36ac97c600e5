"""The EXL3 trellis: 256 weights of a 16x16 tile as 256 K-bit symbols in a tail-biting shift register.

Facts (exllamav3's pack and reconstruct kernels):
- A linear's ``trellis`` is int16 ``[in/16, out/16, 16*K]``: tile (ti, tj) covers rows 16ti.. (inputs) and
  columns 16tj.. (outputs) of W_hat [in, out]; K = bits per weight = ``shape[-1] // 16``.
- Position p (0..255) of a tile's sequence holds the element at row r, column c of the tile, with t = p // 8,
  j = p % 8: r = 2(t % 4) + (j & 1) + 8((j >> 1) & 1), c = t // 4 + 8(j >> 2) (the tensor-core fragment order).
- Each position has a K-bit symbol; its 16-bit state is the last 16 bits of the symbol stream up to and
  including it: state[p] = ((state[p-1] << K) | sym[p]) & 0xFFFF, positions taken mod 256 (tail-biting, so
  state[0] >> K == state[255] & (2^(16-K) - 1)).
- The 256 symbols are concatenated most significant bit first into a 256K-bit stream, cut into 32-bit words
  each stored little-endian: the int16 row read as int32 words gives the stream's words in order.
"""

from __future__ import annotations

from functools import cache

import torch

from .codebook import lookup_table

TILE = 16
POSITIONS = TILE * TILE
K_RANGE = range(1, 9)


@cache
def fragment_order() -> torch.Tensor:
    """perm[p] = r*16 + c: the row-major index in its tile of trellis position p."""
    p = torch.arange(POSITIONS)
    t, j = p // 8, p % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * (j >> 2)
    return r * TILE + c


def bits_of(trellis: torch.Tensor) -> int:
    """K, the bits per weight of a trellis tensor."""
    k = trellis.shape[-1] // TILE
    if trellis.shape[-1] % TILE or k not in K_RANGE:
        raise ValueError(f"a trellis row holds 16*K int16 values for K in 1..8, not {trellis.shape[-1]}")
    return k


def pack(states: torch.Tensor, k: int) -> torch.Tensor:
    """int16 [..., 16K] from the states [..., 256] of tiles (only each state's low K bits, its symbol, are kept)."""
    symbols = states.to(torch.int64) & ((1 << k) - 1)
    shifts = torch.arange(k - 1, -1, -1)
    stream = ((symbols[..., None] >> shifts) & 1).reshape(*states.shape[:-1], POSITIONS * k)  # MSB first
    words = stream.reshape(*states.shape[:-1], 8 * k, 32) << torch.arange(31, -1, -1)
    u32 = words.sum(-1)
    return u32.to(torch.int32).contiguous().view(torch.int16)  # int32 wraps keep the bit pattern


def unpack(trellis: torch.Tensor) -> torch.Tensor:
    """The 16-bit states (int64 [..., 256]) of every tile of ``trellis`` [..., 16K]."""
    k = bits_of(trellis)
    u = trellis.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [..., 8K] stream words
    end = (torch.arange(POSITIONS) + 1) * k + POSITIONS * k  # exclusive end bit of each window (+ one lap)
    first, last = ((end - 16) // 32) % (8 * k), ((end - 1) // 32) % (8 * k)
    shift = ((end - 1) // 32 + 1) * 32 - end
    return (((u[..., first] << 32) | u[..., last]) >> shift) & 0xFFFF


def states_from_symbols(symbols: torch.Tensor, k: int) -> torch.Tensor:
    """The tail-biting states [..., 256] of a tile's symbols [..., 256]."""
    symbols = symbols.to(torch.int64) & ((1 << k) - 1)
    states = torch.zeros_like(symbols)
    for s in range(-(-TILE // k)):  # every symbol that reaches into the 16-bit window
        states |= torch.roll(symbols, s, dims=-1) << (k * s)
    return states & 0xFFFF


def tail_biting(states: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each tile's states [..., 256] form one tail-biting shift register."""
    keep = (1 << (TILE - k)) - 1
    inner = ((states[..., 1:] >> k) == (states[..., :-1] & keep)).all(-1)
    return inner & ((states[..., 0] >> k) == (states[..., -1] & keep))


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
