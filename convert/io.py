"""Atomic output, sha256 of files, and a streaming sharded safetensors writer."""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import UserError
from .tensors import TORCH_TO_ST, TensorMeta

TMP_PREFIX = ".tuneport-tmp-"
NAME_MAX = 255  # bytes in a file name on Linux and macOS file systems


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tuneport-sha256")
_FSYNC_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuneport-fsync")
atexit.register(_HASH_POOL.shutdown, wait=False)
atexit.register(_FSYNC_POOL.shutdown, wait=False)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OrderedHasher:
    """sha256 of bytes fed in file order, computed on a background thread (hashlib releases the GIL),
    so hashing what is read or written anyway costs no extra I/O and little wall time.

    One buffer is hashed while the caller works on the next; ``update`` waits for the previous one,
    which bounds memory to one buffer per hasher.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pending: Future | None = None
        self.pos = 0

    def update(self, data: memoryview | bytes) -> None:
        self.pos += len(data)
        if self._pending is not None:
            self._pending.result()
        self._pending = _HASH_POOL.submit(self._h.update, data)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self._h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("TUNEPORT_CACHE_DIR", Path.home() / ".cache" / "tuneport"))


class HashCache:
    """sha256 of input files, remembered by (path, size, mtime): merging many adapters into one base
    hashes the base once. The file is read once per process (see :func:`hash_cache`); each new digest
    is written through at once (two processes writing at the same time may drop each other's new entries:
    they are hashed again next time). Set TUNEPORT_CACHE_DIR to move it; delete the file to forget."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: dict | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _key(p: Path) -> tuple[str, int, int]:
        st = p.stat()
        return str(p.resolve()), st.st_size, st.st_mtime_ns

    def _entries(self) -> dict:
        if self._data is None:
            try:
                loaded = json.loads(self.path.read_text())
                self._data = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def get(self, p: Path) -> str | None:
        name, size, mtime = self._key(p)
        with self._lock:
            e = self._entries().get(name)
        return e["sha256"] if e and e.get("size") == size and e.get("mtime_ns") == mtime else None

    def put(self, p: Path, digest: str) -> None:
        name, size, mtime = self._key(p)
        with self._lock:
            data = self._entries()
            data[name] = {"size": size, "mtime_ns": mtime, "sha256": digest}
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                tmp.write_text(json.dumps(data))
                tmp.replace(self.path)


_HASH_CACHES: dict[Path, HashCache] = {}
_HASH_CACHES_LOCK = threading.Lock()


def hash_cache() -> HashCache:
    """The process's hash cache for the current cache directory."""
    path = cache_dir() / "sha256.json"
    with _HASH_CACHES_LOCK:
        if path not in _HASH_CACHES:
            _HASH_CACHES[path] = HashCache(path)
        return _HASH_CACHES[path]


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_output_path(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless ``force``, and a name no file system holds."""
    try:
        exists = out.exists()
    except (OSError, ValueError) as e:  # ENAMETOOLONG, an embedded NUL byte
        raise UserError(f"output path {str(out)[:200]} is not usable ({getattr(e, 'strerror', None) or e})",
                        "choose another --out") from None
    if exists and not force:
        raise UserError(f"output path {out} already exists", "choose another --out or pass --force")
    room = NAME_MAX - len(f"{TMP_PREFIX}{'9' * 7}--{'0' * 8}")  # the temporary beside it adds these (pid <= 7 digits)
    if len(out.name.encode()) > room:
        raise UserError(f"output name {out.name[:40]}... is {len(out.name.encode())} bytes, over the {room} that "
                        "leave room for the temporary written beside it", "choose a shorter --out")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove temporary siblings of ``out`` left by a killed run (their process is gone)."""
    removed = []
    # exactly <prefix><name>-<pid>-<8 hex>: a sibling output such as "run-5" has temporaries "run" must not touch
    own = re.compile(re.escape(f"{TMP_PREFIX}{out.name}-") + r"(\d+)-[0-9a-f]{8}")
    for p in out.parent.glob(f"{TMP_PREFIX}{out.name}-*"):
        m = own.fullmatch(p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # the disk, a quota or a file-size limit is full


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory of ``out``; on success fsync and rename it to ``out``.

    On any failure the temporary directory is removed and ``out`` is left as it was.
    """
    out = Path(out).absolute()
    check_output_path(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            old = out.parent / f"{TMP_PREFIX}old-{out.name}-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
        fsync_dir(out.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in NO_SPACE:
            raise UserError(f"no space left on the device of {out.parent} while writing {out.name}",
                            "free space there or write elsewhere (nothing was left at the output path)") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
            shard.fsynced = _FSYNC_POOL.submit(fsync_path, shard.path)
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


def config_digest(model_dir: Path) -> str:
    """A short sha256 of a model's config.json: part of the cache key of anything converted for that base
    (two bases may share their weight files and compute differently)."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:12]


def content_digest(directory: Path) -> str:
    """A short sha256 of a directory's files (names and bytes): the cache key of a converted adapter."""
    h = hashlib.sha256()
    for p in sorted(x for x in directory.iterdir() if x.is_file()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:24]


def write_once(out: Path, write: Callable[[Path], None]) -> Path:
    """Create the cache entry ``out`` (file or directory) with ``write(tmp)`` on a unique temporary sibling,
    then rename; an entry that exists, or that a concurrent writer renamed first, is kept."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _writer_lock(out.with_name(f".{out.name}.lock")):  # a concurrent writer waits, then finds the entry
        if out.exists():
            return out
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            write(tmp)
            try:
                tmp.replace(out)
            except OSError:
                if not out.exists():
                    raise
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            elif tmp.exists():
                tmp.unlink()
    return out


@contextlib.contextmanager
def _writer_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (none where fcntl is missing: the rename alone keeps entries whole).
    The file is removed after: a writer that comes later finds the entry and never takes the lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
            fcntl.flock(f, fcntl.LOCK_UN)
