"""Tensors between torch and mlx without a float round trip (bfloat16 travels as its 16 bits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

TORCH_TO_MX = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def to_mx(t: torch.Tensor) -> mx.array:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def to_torch(a: mx.array) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """fp32/fp16 tensors as numpy arrays (what ``mx.array`` and ``mx.save_safetensors`` take)."""
    return t.detach().contiguous().numpy()
