"""Reading GGUF files (models and LoRAs): the one place that opens them for metadata and tensor shapes,
and that checks a GGUF LoRA against its model before llama.cpp loads it.

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


def check_gguf_lora(path: Path, model_arch: str, model_shapes: dict[str, tuple[int, ...]]) -> int:
    """Validate a GGUF LoRA file against a model (its architecture and tensor shapes, torch order) before
    llama.cpp sees it: a bad file gives a NULL adapter, and a NULL adapter crashes at decode. Returns bytes."""
    if not path.is_file():
        raise UserError(f"{path} is not a GGUF LoRA file", "pass a file written by tuneport export --target gguf")
    r = open_gguf(path)
    if not is_lora(r):
        raise UserError(f"{path.name} is not a GGUF LoRA adapter", "export it with --adapters separate")
    arch = gguf_field(r, "general.architecture")
    if arch != model_arch:
        raise UserError(f"{path.name} is for architecture {arch!r}, the model is {model_arch!r}",
                        "use an adapter made for this base")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in tensor_shapes(r).items():
        base, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise UserError(f"{path.name}: unexpected tensor {name}", "re-export the adapter")
        pairs.setdefault(base, {})[part] = shape
    for base, ab in pairs.items():
        shape = model_shapes.get(base)
        if shape is None or len(ab) != 2:
            raise UserError(f"{path.name}: {base} is not in the model or lacks lora_a/lora_b",
                            "the adapter was made for another base")
        a, b = ab["lora_a"], ab["lora_b"]
        if base == "token_embd.weight":
            ok = a[0] == shape[0] and b[0] == shape[1] and a[1] == b[1]
        else:
            ok = a[1] == shape[1] and b[0] == shape[0] and a[0] == b[1]
        if not ok:
            raise UserError(f"{path.name}: {base} LoRA shapes {list(a)}, {list(b)} do not fit the model's "
                            f"{list(shape)}", "the adapter was made for another base")
    return path.stat().st_size
