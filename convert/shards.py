"""A streaming sharded safetensors writer: every shard's header written first, each tensor then straight to its
place on disk (hashed and fsynced in the background), so nothing but the current tensor is in memory."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .atomic import FSYNC_POOL, fsync_path
from .hashing import OrderedHasher, sha256_file
from .tensors import TORCH_TO_ST, TensorMeta


@dataclass
class _Shard:
    path: Path
    specs: list[TensorMeta]
    offsets: dict[str, int] = field(default_factory=dict)  # absolute file offsets of tensor data
    written: set[str] = field(default_factory=set)
    hasher: OrderedHasher = field(default_factory=OrderedHasher)  # hashes tensor i while i+1 is written
    fsynced: Future | None = None
    in_order: bool = True


def plan_shards(specs: list[TensorMeta], max_shard_bytes: int) -> list[list[TensorMeta]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[TensorMeta]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


class ShardedSafetensorsWriter:
    """Writes tensors one at a time into pre-planned safetensors shards.

    The header of every shard is written first (all shapes and dtypes are known in advance), so
    each tensor goes straight to its place on disk and nothing but the current tensor is in memory.
    Produces ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index json.
    """

    def __init__(
        self,
        directory: Path,
        specs: list[TensorMeta],
        max_shard_bytes: int = 2 << 30,
        metadata: dict[str, str] | None = None,
        basename: str = "model",
    ) -> None:
        self.directory = Path(directory)
        self.basename = basename
        groups = plan_shards(specs, max_shard_bytes)
        n = len(groups)
        self.shards: list[_Shard] = []
        self.where: dict[str, _Shard] = {}
        for i, group in enumerate(groups):
            fname = (
                f"{basename}.safetensors" if n == 1 else f"{basename}-{i + 1:05d}-of-{n:05d}.safetensors"
            )
            shard = _Shard(self.directory / fname, group)
            self._write_header(shard, metadata or {"format": "pt"})
            self.shards.append(shard)
            for s in group:
                self.where[s.name] = shard
        self.specs = {s.name: s for s in specs}
        self._queue: queue.Queue = queue.Queue()
        self._slot = threading.Semaphore(1)  # one tensor in flight: bounded memory
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @staticmethod
    def _write_header(shard: _Shard, metadata: dict[str, str]) -> None:
        header: dict[str, object] = {"__metadata__": metadata}
        pos = 0
        rel: dict[str, int] = {}
        for s in shard.specs:
            header[s.name] = {
                "dtype": TORCH_TO_ST[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [pos, pos + s.nbytes],
            }
            rel[s.name] = pos
            pos += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # align data to 8 bytes, as safetensors does
        base = 8 + len(raw)
        with open(shard.path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            f.truncate(base + pos)
        shard.hasher.update(struct.pack("<Q", len(raw)) + raw)
        shard.offsets = {k: base + v for k, v in rel.items()}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Hand ``tensor`` to a background thread that writes and hashes it (and fsyncs each finished
        shard) while the caller computes the next one. Waits until the previous tensor is written, so
        at most one tensor is in flight."""
        spec = self.specs[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"{name}: planned {spec.dtype}{list(spec.shape)}, got {tensor.dtype}{list(tensor.shape)}"
            )
        self._raise_thread_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="tuneport-writer", daemon=True)
            self._thread.start()
        self._slot.acquire()
        self._queue.put((name, tensor.detach().contiguous()))

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._write_now(*item)
                except BaseException as e:  # reported on the caller's next write() or close()
                    self._error = e
            del item
            self._slot.release()

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_now(self, name: str, tensor: torch.Tensor) -> None:
        shard = self.where[name]
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        offset = shard.offsets[name]
        fd = os.open(shard.path, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
            shard.written.add(name)
        finally:
            os.close(fd)
        if len(shard.written) == len(shard.specs):  # complete: flush it while later shards are computed
            shard.fsynced = FSYNC_POOL.submit(fsync_path, shard.path)
        if shard.in_order and offset == shard.hasher.pos:
            shard.hasher.update(data)
        else:
            shard.in_order = False

    def stop(self) -> None:
        """End the writer thread without raising (after a failure elsewhere)."""
        with contextlib.suppress(BaseException):
            self._finish_thread()

    def _finish_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for shard in self.shards:
            if shard.fsynced is not None:
                shard.fsynced.result()
        self._raise_thread_error()

    def sha256(self) -> dict[Path, str]:
        """sha256 of every shard: from the in-order stream when possible, else by reading the file."""
        return {sh.path: sh.hasher.hexdigest() if sh.in_order else sha256_file(sh.path) for sh in self.shards}

    def close(self) -> list[Path]:
        """Wait for queued writes; check every planned tensor was written; write the index json."""
        self._finish_thread()
        missing = [s.name for sh in self.shards for s in sh.specs if s.name not in sh.written]
        if missing:
            raise RuntimeError(f"tensors planned but never written: {missing[:5]}")
        files = [sh.path for sh in self.shards]
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for s in self.specs.values())},
                "weight_map": {name: sh.path.name for name, sh in self.where.items()},
            }
            idx = self.directory / f"{self.basename}.safetensors.index.json"
            idx.write_text(json.dumps(index, indent=2))
            files.append(idx)
        return files


def write_tensors(directory: Path, specs: list[TensorMeta], sources: list[TensorMeta],
                  produce: Callable[[TensorMeta], Iterable[tuple[str, torch.Tensor]]], *, max_shard_bytes: int,
                  progress: Callable[[int, int, str], None] | None = None,
                  metadata: dict[str, str] | None = None) -> dict[Path, str]:
    """Write the tensors ``produce(source)`` yields for each source in turn (all planned in ``specs``) into
    safetensors shards under ``directory``; progress counts source bytes. Returns the shards' sha256."""
    writer = ShardedSafetensorsWriter(directory, specs, max_shard_bytes=max_shard_bytes, metadata=metadata)
    total = sum(s.nbytes for s in sources)
    done = 0
    try:
        for source in sources:
            for name, tensor in produce(source):
                writer.write(name, tensor)
            done += source.nbytes
            if progress:
                progress(done, total, source.name)
        writer.close()
    finally:
        writer.stop()
    return writer.sha256()
