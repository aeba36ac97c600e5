"""What a tensor is without its data: name, dtype, shape. One dataclass for every reader and writer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# safetensors dtype names <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U32": torch.uint32,  # MLX packed weights
    "BOOL": torch.bool,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as stored or planned: enough to write a safetensors header or to size a plan."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize
