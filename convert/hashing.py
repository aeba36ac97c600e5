"""sha256 of files: computed on a background thread while the bytes are read or written anyway, remembered
across runs by (path, size, mtime), and the short digests that key tuneport's caches."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .cache import cache_dir

_HASH_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tuneport-sha256")
atexit.register(_HASH_POOL.shutdown, wait=False)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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
