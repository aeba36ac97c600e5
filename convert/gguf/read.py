"""Reading GGUF files (models and LoRAs): the one place that opens them for metadata and tensor shapes.

Used by ``inspect``, the serving policy and the llama.cpp backend, so all three read a file the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped, nothing loaded); UserError if it is not GGUF."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise UserError("reading GGUF needs the gguf package", "pip install 'tuneport[gguf]'") from e
    try:
        return GGUFReader(str(path))
    except Exception as e:
        raise UserError(f"{path} is not a valid GGUF file ({type(e).__name__})", "re-export or re-download it") from e


def gguf_field(reader, key: str) -> Any:
    """A metadata value (str, number or list), or None when absent or unreadable."""
    f = reader.fields.get(key)
    try:
        return f.contents() if f is not None else None
    except Exception:
        return None


def torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF stores ``ne`` innermost first)."""
    return tuple(int(x) for x in reversed(tensor.shape.tolist()))


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    return {t.name: torch_shape(t) for t in reader.tensors}


def is_lora(reader) -> bool:
    return gguf_field(reader, "general.type") == "adapter" and gguf_field(reader, "adapter.type") == "lora"
