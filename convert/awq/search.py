"""AWQ's two searches, on a sample of a group's real inputs.

Scale search: for alpha on a grid in [0, 1), s = mean|x|^alpha (normalised so that max·min = 1); the
alpha whose ``Q(W·s)/s`` best reproduces the group's fp32 outputs wins (alpha 0 is "no scaling").
Clip search: per (output row, group), the max |w| shrunk by the ratio in [0.5, 1] that best reproduces
that group's partial outputs after quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import QuantScheme, fake_quantize

SCALE_GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512
CLIP_ROWS = 256  # output rows per clip-search batch (bounded memory)


@dataclass
class ScaleResult:
    scale: torch.Tensor  # [in]
    alpha: float
    loss: float  # output MSE with the best scale
    loss_unscaled: float  # output MSE of plain round-to-nearest


def search_scale(x: torch.Tensor | list[torch.Tensor], mean_abs: torch.Tensor, weights: list[torch.Tensor],
                 scheme: QuantScheme) -> ScaleResult:
    """The per-input-channel scale for linears ``weights`` ([out, in] fp32) reading ``x`` ([tokens, in]; or one
    input per weight, as the experts of a mixture each read the tokens routed to them)."""
    inputs = x if isinstance(x, list) else [x] * len(weights)
    refs = [xi @ w.T for xi, w in zip(inputs, weights, strict=True)]
    best = (float("inf"), 0.0, torch.ones_like(mean_abs))
    base_loss = None
    for i in range(SCALE_GRID):
        alpha = i / SCALE_GRID
        s = mean_abs.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = sum(float(((xi / s) @ fake_quantize(w * s, scheme).T - r).pow(2).mean())
                   for xi, w, r in zip(inputs, weights, refs, strict=True))
        if base_loss is None:
            base_loss = loss
        if loss < best[0]:
            best = (loss, alpha, s)
    return ScaleResult(best[2], best[1], best[0], base_loss or 0.0)


def search_clip(x: torch.Tensor, w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Per (row, group) max |w| after clipping: ``[out, in/G]``."""
    g = scheme.group_size
    out_f, in_f = w.shape
    if len(x) > CLIP_TOKENS:
        x = x[torch.linspace(0, len(x) - 1, CLIP_TOKENS).long()]
    xg = x.reshape(len(x), in_f // g, g)  # [t, n_g, G]
    best_max = torch.empty(out_f, in_f // g)
    for r in range(0, out_f, CLIP_ROWS):
        wr = w[r:r + CLIP_ROWS]
        wg = wr.reshape(len(wr), in_f // g, g)  # [o, n_g, G]
        org_max = wg.abs().amax(dim=-1)  # [o, n_g]
        ref = torch.einsum("tgk,ogk->otg", xg, wg)
        best_err = torch.full_like(org_max, float("inf"))
        best = org_max.clone()
        for i in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
            max_val = org_max * (1 - i / CLIP_GRID)
            clipped = torch.maximum(torch.minimum(wg, max_val.unsqueeze(-1)), -max_val.unsqueeze(-1))
            q = fake_quantize(clipped.reshape(len(wr), in_f), scheme).reshape_as(wg)
            err = (torch.einsum("tgk,ogk->otg", xg, q) - ref).pow(2).mean(dim=1)  # [o, n_g]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, max_val, best)
        best_max[r:r + CLIP_ROWS] = best
    return best_max


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    wg = w.reshape(w.shape[0], -1, group_size)
    m = max_val.unsqueeze(-1)
    return torch.maximum(torch.minimum(wg, m), -m).reshape(w.shape)
