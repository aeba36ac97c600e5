"""The 128-wide Hadamard rotations of EXL3 and the reconstruction of a linear's weight.

H is the Sylvester Hadamard matrix of order 128 in natural order (H[i, j] = (-1)^popcount(i & j)) scaled by
1/sqrt(128), so H = H^T = H^-1. With W_hat the decoded tiles ([in, out]), exllamav3's weight is
    W = diag(suh) . (I ⊗ H) . W_hat . (I ⊗ H) . diag(svh)        (y = x @ W + bias; nn.Linear.weight = W^T)
with the block-diagonal rotations acting on 128-row and 128-column blocks.
"""

from __future__ import annotations

import math
from functools import cache

import torch

BLOCK = 128


@cache
def hadamard_128() -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order 128 (fp32)."""
    i = torch.arange(BLOCK)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for b in range(7):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).float() / math.sqrt(BLOCK)


def rotate_rows(w: torch.Tensor) -> torch.Tensor:
    """(I ⊗ H) @ w for w [k, n], k a multiple of 128."""
    k, n = w.shape
    return (hadamard_128() @ w.reshape(k // BLOCK, BLOCK, n)).reshape(k, n)


def rotate_cols(w: torch.Tensor) -> torch.Tensor:
    """w @ (I ⊗ H) for w [k, n], n a multiple of 128."""
    k, n = w.shape
    return (w.reshape(k, n // BLOCK, BLOCK) @ hadamard_128()).reshape(k, n)


def reconstruct(w_hat: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """exllamav3's weight [in, out] (fp32) from the decoded tiles and the two scale vectors."""
    if w_hat.shape[0] % BLOCK or w_hat.shape[1] % BLOCK:
        raise ValueError(f"EXL3 weights are padded to multiples of {BLOCK}; got {tuple(w_hat.shape)}")
    w = rotate_rows(w_hat.float()) * suh.float()[:, None]
    return rotate_cols(w) * svh.float()[None, :]


def regularize(w: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """The inverse of ``reconstruct`` without quantization: the W_hat that rebuilds ``w`` [in, out] exactly
    (a test encoder quantizes this)."""
    w = rotate_cols(w.float() / svh.float()[None, :])
    return rotate_rows(w / suh.float()[:, None])
