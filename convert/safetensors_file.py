"""A validating, mmap-free safetensors reader: one tensor at a time with ``readinto``.

Reading with explicit reads (not mmap) keeps resident memory to the tensor being read, and checking
the header up front turns truncated or corrupt files into a clear :class:`UserError`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from .errors import UserError
from .hashing import OrderedHasher, hash_cache, sha256_file
from .tensors import ST_DTYPES, TensorMeta

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

def _bad(path: Path, what: str) -> UserError:
    return UserError(
        f"{path} is not a valid safetensors file ({what})",
        "the file is truncated or corrupt: download or copy it again",
    )


def _count(d: object) -> int:
    """A dimension: an integer >= 0 (not a bool, a float or a string)."""
    if not isinstance(d, int) or isinstance(d, bool) or d < 0:
        raise ValueError(f"bad dimension {d!r}")
    return d


class SafetensorsFile:
    """Header of one ``.safetensors`` file, validated against the file size."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise _bad(self.path, f"only {size} bytes, no header")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > MAX_HEADER_BYTES:
                    raise _bad(self.path, f"header length {n} is larger than the file ({size} bytes)")
                raw = f.read(n)
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror}", "check the path and permissions") from e
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(self.path, f"corrupt header JSON: {str(e)[:80]}") from e
        except RecursionError as e:
            raise _bad(self.path, "corrupt header JSON: nested too deeply") from e
        self.size = size
        self._known_sha256 = hash_cache().get(self.path)
        self._hasher = OrderedHasher()
        if self._known_sha256 is None:
            self._hasher.update(head + raw)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise _bad(self.path, "__metadata__ is not a JSON object")
        base = 8 + n
        self.tensors: dict[str, TensorMeta] = {}
        self.offsets: dict[str, int] = {}  # absolute byte offset of each tensor's data
        for name, entry in header.items():
            try:
                dtype = ST_DTYPES[entry["dtype"]]
                shape = tuple(_count(d) for d in entry["shape"])
                if math.prod(d for d in shape if d) * dtype.itemsize >= 2**63:  # torch cannot size it, even empty
                    raise ValueError(f"shape {list(shape)} is too large")
                lo, hi = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise _bad(self.path, f"bad entry for tensor {name!r}") from e
            meta = TensorMeta(name, dtype, shape)
            if hi - lo != meta.nbytes or lo < 0:
                raise _bad(self.path, f"tensor {name!r} has {hi - lo} bytes for shape {list(shape)}")
            if base + hi > size:
                raise _bad(self.path, f"tensor {name!r} ends at byte {base + hi}, file has {size}")
            self.tensors[name] = meta
            self.offsets[name] = base + lo
        spans = sorted((self.offsets[k], self.offsets[k] + m.nbytes, k) for k, m in self.tensors.items() if m.nbytes)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:  # two tensors over the same bytes: the safetensors library refuses it too
                raise _bad(self.path, f"tensors {first!r} and {second!r} overlap")

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return self._read_into(name, self.offsets[name], torch.empty(info.shape, dtype=info.dtype))

    def read_rows(self, name: str, first: int, shape: tuple[int, ...]) -> torch.Tensor:
        """``prod(shape)`` contiguous elements of ``name`` from its flat element ``first``, as ``shape``: one
        expert's rows of a fused [E, rows, cols] tensor, without reading the others."""
        info = self.tensors[name]
        out = torch.empty(shape, dtype=info.dtype)
        if first < 0 or (first + out.numel()) > info.numel:
            raise ValueError(f"rows {first}..+{out.numel()} lie outside {name} {list(info.shape)}")
        return self._read_into(name, self.offsets[name] + first * info.dtype.itemsize, out)

    def _read_into(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        nbytes = out.numel() * out.element_size()
        if nbytes:
            buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            fd = os.open(self.path, os.O_RDONLY)
            try:
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [buf[done:]], start + done)
                    if got <= 0:
                        raise _bad(self.path, f"short read of tensor {name!r}")
                    done += got
            finally:
                os.close(fd)
            if self._known_sha256 is None and start == self._hasher.pos:
                self._hasher.update(buf)
        return out

    def sha256(self) -> str:
        """sha256 of the file; free when every tensor was read in file order, else read again."""
        if self._known_sha256 is None:
            digest = self._hasher.hexdigest() if self._hasher.pos == self.size else sha256_file(self.path)
            hash_cache().put(self.path, digest)
            self._known_sha256 = digest
        return self._known_sha256
