"""Reading GGUF files (models and LoRAs): the one place that opens them for metadata and tensor shapes,
and that checks a GGUF LoRA against its model before llama.cpp loads it.

Used by ``inspect``, the serving policy and the llama.cpp backend, so all three read a file the same way.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from pathlib import Path
from typing import Any

from ..errors import UserError

GGML_MAX_DIMS = 4  # llama.cpp refuses a tensor with more
VERSIONS = (2, 3)  # the GGUF versions llama.cpp and the gguf package read


def _bad(path: str | Path, why: str) -> UserError:
    return UserError(f"{path} is not a valid GGUF file ({why})", "re-export or re-download it")


def _problem(path: str | Path, e: Exception) -> str:
    """What is wrong with a file ``GGUFReader`` refused, in words (its own messages are numpy's)."""
    try:
        with open(path, "rb") as f:
            head, size = f.read(8), Path(path).stat().st_size
    except OSError as oe:
        return f"cannot read it: {oe.strerror}"
    if size == 0:
        return "the file is empty"
    if head[:4] != b"GGUF":
        return f"it starts with {head[:4]!r}, not GGUF"
    if len(head) == 8:
        version = min(struct.unpack("<I", head[4:])[0], struct.unpack(">I", head[4:])[0])  # either byte order
        if version not in VERSIONS:
            return f"GGUF version {version}; llama.cpp reads versions {' and '.join(map(str, VERSIONS))}"
    msg = str(e)
    if m := re.search(r"\((\d+)\) is not a valid (GGUFValueType|GGMLQuantizationType)", msg):
        return f"unknown {'metadata value' if m[2] == 'GGUFValueType' else 'tensor'} type {m[1]}"
    if isinstance(e, ValueError) and "duplicated tensor" in msg:
        return f"two tensors named {msg.rsplit(' ', 1)[-1]}"
    if isinstance(e, ValueError) and "alignment" in msg:
        return "general.alignment is not a power of two"
    return f"truncated or corrupt: its metadata or tensors run past its {size} bytes"


@functools.cache
def _strict_reader():
    """``gguf.GGUFReader`` stopping at the end of the file. gguf reads past the end as empty arrays, so an array
    that claims more items than the file holds loops (and grows) for as long as it claims: a hang."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class StrictGGUFReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            arr = super()._get(offset, dtype, count, override_order)
            if arr.size != int(count):
                raise ValueError("read past the end of the file")
            return arr

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == GGUFValueType.ARRAY:  # the smallest its items can be, times their count, must fit
                itype, count = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                scalar = self.gguf_scalar_to_np.get(itype) if itype in GGUFValueType._value2member_map_ else None
                smallest = np.dtype(scalar).itemsize if scalar else 8 if itype == GGUFValueType.STRING else 12
                if count * smallest > len(self.data) - orig_offs - 12:
                    raise ValueError("read past the end of the file")
            return super()._get_field_parts(orig_offs, raw_type)

    return StrictGGUFReader


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped, nothing loaded); UserError if it is not GGUF, or
    not a file llama.cpp would load (a tensor of more than 4 dimensions, or data off the alignment)."""
    try:
        reader_class = _strict_reader()
    except ImportError as e:
        raise UserError("reading GGUF needs the gguf package", "pip install 'tuneport[gguf]'") from e
    import numpy as np

    try:
        with np.errstate(all="ignore"):  # gguf adds offsets in uint64 (wrapping; checked below), a warning each
            reader = reader_class(str(path))
    except Exception as e:
        raise _bad(path, _problem(path, e)) from e
    align, end = int(reader.alignment), len(reader.data) - int(reader.data_offset)
    for t in reader.tensors:  # what llama.cpp checks and gguf does not (it computes in wrapping uint64)
        if len(t.shape) > GGML_MAX_DIMS:
            raise _bad(path, f"tensor {t.name} has {len(t.shape)} dimensions; llama.cpp allows {GGML_MAX_DIMS}")
        numel, offset = math.prod(int(d) for d in t.shape), int(t.field.parts[-1][0])
        if numel != int(t.n_elements) or numel >= 2**63:
            raise _bad(path, f"tensor {t.name}'s shape {[int(d) for d in t.shape]} overflows")
        if offset % align:
            raise _bad(path, f"tensor {t.name}'s data is not aligned to {align} bytes")
        if offset + int(t.n_bytes) > end:
            raise _bad(path, f"tensor {t.name}'s data runs past the end of the file")
    return reader


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
        elif len(shape) == 3:  # stacked experts [E, out, in]: lora_a [E, r, in], lora_b [E, out, r]
            ok = a[0] == b[0] == shape[0] and a[2] == shape[2] and b[1] == shape[1] and a[1] == b[2]
        else:
            ok = a[1] == shape[1] and b[0] == shape[0] and a[0] == b[1]
        if not ok:
            raise UserError(f"{path.name}: {base} LoRA shapes {list(a)}, {list(b)} do not fit the model's "
                            f"{list(shape)}", "the adapter was made for another base")
    return path.stat().st_size
