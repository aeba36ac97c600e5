"""Reading GGUF files (models and LoRAs): the one place that opens them for metadata and tensor shapes,
and that checks a GGUF LoRA against its model before llama.cpp loads it.

Used by ``inspect``, the serving policy and the llama.cpp backend, so all three read a file the same way.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

GGML_MAX_DIMS = 4  # llama.cpp refuses a tensor with more
VERSIONS = (2, 3)  # the GGUF versions llama.cpp and the gguf package read


def _bad(path: str | Path, why: str) -> UserError:
    return UserError(f"{path} is not a valid GGUF file ({why})", "re-export or re-download it")


class _Corrupt(Exception):
    """What is wrong with a file's bytes, in words (becomes the UserError's reason)."""


# GGUF metadata value types (gguf.GGUFValueType's numbers): struct format of the scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in a GGUF header: ``shape`` as GGUF stores it (``ne``, innermost first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the file


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (decoded values) and tensor entries; no tensor data is read."""

    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    alignment: int
    data_offset: int


class _HeaderParser:
    """The header of a GGUF file, parsed straight from its bytes (gguf's ``GGUFReader`` builds a numpy view per
    string: a minute for a 200k-token vocabulary). Every count is checked against the bytes left, so a corrupt
    count is an error at once, never a long loop."""

    def __init__(self, buf, order: str) -> None:
        self.buf, self.o, self.pos = buf, order, 0

    def past_end(self) -> _Corrupt:
        return _Corrupt(f"truncated or corrupt: its metadata or tensors run past its {len(self.buf)} bytes")

    def need(self, n: int) -> None:
        if n > len(self.buf) - self.pos:
            raise self.past_end()

    def _unpack(self, spec: str) -> tuple:
        size = struct.calcsize(self.o + spec)
        self.need(size)
        vals = struct.unpack_from(self.o + spec, self.buf, self.pos)
        self.pos += size
        return vals

    def take(self, fmt: str):
        """One value per letter of ``fmt`` (the value itself for one letter)."""
        vals = self._unpack(fmt)
        return vals if len(vals) > 1 else vals[0]

    def many(self, fmt: str, count: int) -> tuple:
        """``count`` values of the one-letter format ``fmt`` (the count checked before struct sees it)."""
        self.need(count * struct.calcsize(self.o + fmt))
        return self._unpack(f"{count}{fmt}")

    def raw_string(self) -> bytes:
        n = self.take("Q")
        self.need(n)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def key(self) -> str:
        try:
            return self.raw_string().decode()
        except UnicodeDecodeError:
            raise _Corrupt("a metadata key or tensor name is not UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.raw_string().decode("utf-8", "replace")
        if (fmt := _SCALARS.get(vtype)) is not None:
            return self.take(fmt)
        if vtype != _ARRAY:
            raise _Corrupt(f"unknown metadata value type {vtype}")
        itype, count = self.take("IQ")
        if (fmt := _SCALARS.get(itype)) is not None:  # numbers: one unpack for the whole array
            return list(self.many(fmt, count))
        if itype not in (_STRING, _ARRAY):
            raise _Corrupt(f"unknown metadata value type {itype}")
        self.need(count * (8 if itype == _STRING else 12))  # the smallest an item can be
        if itype == _ARRAY:
            return [self.value(itype) for _ in range(count)]
        buf, pos, end, length = self.buf, self.pos, len(self.buf), struct.Struct(self.o + "Q").unpack_from
        items = []
        for _ in range(count):  # a vocabulary: 200k strings, one tight loop
            if pos + 8 > end or (n := length(buf, pos)[0]) > end - pos - 8:
                raise self.past_end()
            items.append(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
        self.pos = pos
        return [b.decode("utf-8", "replace") for b in items]


def _parse_header(buf) -> GGUFHeader:
    """The header of the GGUF bytes ``buf`` (a memory map), or _Corrupt."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if bytes(buf[:4]) != b"GGUF":
        raise _Corrupt(f"it starts with {bytes(buf[:4])!r}, not GGUF")
    order = "<"
    if len(buf) >= 8 and struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0:
        order = ">"  # a big-endian file (gguf's and llama.cpp's test for it)
    p = _HeaderParser(buf, order)
    p.pos = 4
    version = p.take("I")
    if version not in VERSIONS:
        raise _Corrupt(f"GGUF version {version}; llama.cpp reads versions {' and '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = p.take("QQ")
    p.need(n_kv * 12)  # the smallest a key/value can be
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.key()
        if key in fields:
            raise _Corrupt(f"metadata key {key} appears twice")
        fields[key] = p.value(p.take("I"))
    p.need(n_tensors * 24)  # the smallest a tensor entry can be
    entries = []
    for _ in range(n_tensors):
        name = p.key()
        dims = p.many("Q", p.take("I"))
        entries.append((name, dims, *p.take("IQ")))
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise _Corrupt("general.alignment is not a power of two")
    data_offset = p.pos + (-p.pos % align)
    tensors, names = [], set()
    for name, dims, ggml_type, offset in entries:
        if name in names:
            raise _Corrupt(f"two tensors named {name}")
        names.add(name)
        if ggml_type not in GGMLQuantizationType._value2member_map_:
            raise _Corrupt(f"unknown tensor type {ggml_type}")
        if len(dims) > GGML_MAX_DIMS:
            raise _Corrupt(f"tensor {name} has {len(dims)} dimensions; llama.cpp allows {GGML_MAX_DIMS}")
        numel = math.prod(dims)
        if numel >= 2**63:
            raise _Corrupt(f"tensor {name}'s shape {list(reversed(dims))} overflows")
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if offset % align:
            raise _Corrupt(f"tensor {name}'s data is not aligned to {align} bytes")
        n_bytes = numel * type_size // block
        if data_offset + offset + n_bytes > len(buf):
            raise _Corrupt(f"truncated or corrupt: tensor {name}'s data runs past its {len(buf)} bytes")
        tensors.append(GGUFTensorInfo(name, dims, qtype, numel, n_bytes, data_offset + offset))
    return GGUFHeader(version, fields, tensors, align, data_offset)


def open_gguf(path: str | Path) -> GGUFHeader:
    """The metadata and tensor entries of the GGUF file ``path`` (memory-mapped while read; no tensor data is
    read); UserError if it is not GGUF, or not a file llama.cpp would load (a tensor of more than 4 dimensions,
    data off the alignment or past the end of the file)."""
    import mmap

    try:
        import gguf.constants  # noqa: F401 - the tensor types' block sizes
    except ImportError as e:
        raise UserError("reading GGUF needs the gguf package", "pip install 'tuneport[gguf]'") from e
    try:
        with open(path, "rb") as f:
            if Path(path).stat().st_size == 0:
                raise _Corrupt("the file is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse_header(mm)
    except _Corrupt as e:
        raise _bad(path, str(e)) from None
    except OSError as e:
        raise _bad(path, f"cannot read it: {e.strerror}") from None


def gguf_field(reader: GGUFHeader, key: str) -> Any:
    """A metadata value (str, number or list), or None when absent."""
    return reader.fields.get(key)


def torch_shape(tensor: GGUFTensorInfo) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF stores ``ne`` innermost first)."""
    return tuple(reversed(tensor.shape))


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
