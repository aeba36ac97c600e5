"""The adapter pool: which adapters are loaded in an engine, within a capacity.

- capacity: at most ``max_adapters`` loaded at once;
- pinning: pinned adapters are never evicted (start-up adapters pin unless told otherwise);
- reference counts: an adapter in use by a request is never evicted or unloaded;
- LRU: when a new adapter needs a slot, the least recently used idle, unpinned adapter is evicted;
- on-demand: an unknown name is loaded from ``adapter_dir/<name>`` when that is a valid adapter.

The pool is engine-agnostic: it calls ``load(name, path)`` / ``unload(name)`` callbacks that the engine
provides. Loads run without the pool's lock; unloads (evictions, removals) still run under it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ApiError

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger(__name__)


class PoolError(ApiError):
    """A pool request that cannot be served; ``status`` is the HTTP status a gateway should answer."""


class AlreadyLoaded(PoolError):
    """The name is loaded already (409)."""


@dataclass
class PoolEntry:
    name: str
    path: Path
    pinned: bool = False
    refs: int = 0
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    nbytes: int = 0
    hits: int = 0

    def state(self) -> dict:
        return {"name": self.name, "path": str(self.path), "pinned": self.pinned, "in_use": self.refs > 0,
                "refs": self.refs, "loaded_at": self.loaded_at, "last_used": self.last_used,
                "bytes": self.nbytes, "hits": self.hits}


@dataclass
class PoolStats:
    loads: int = 0
    evictions: int = 0
    hits: int = 0
    misses: int = 0


def check_name(name: str) -> str:
    if not ADAPTER_NAME.match(name or ""):
        raise PoolError(f"invalid adapter name {name!r}", "names match [A-Za-z0-9._-]{1,64}", status=400)
    return name


def resolve_inside(path: str | Path, roots: list[Path]) -> Path:
    """``path`` resolved (symbolic links followed), refused (403) unless it lies inside one of ``roots``,
    and, for a directory, unless every link in it leads inside them too."""
    raw = str(path)
    if ".." in Path(raw).parts:
        raise PoolError(f"adapter path {raw!r} contains '..'", "pass a path inside the allowed roots", status=403)
    p = Path(raw).expanduser().resolve()
    if not _inside(p, roots):
        raise PoolError(f"adapter path {raw!r} is outside the allowed roots" + (" once its links are followed"
                        if p != Path(raw).expanduser().absolute() else ""),
                        "pass a path under --adapter-dir or one given at start-up", status=403)
    if p.is_dir() and (out := _link_out(p, roots)) is not None:
        raise PoolError(f"adapter path {raw!r} holds {str(out.relative_to(p))!r}, a link that leads outside the "
                        "allowed roots", "copy the file into the adapter directory", status=403)
    return p


def _inside(p: Path, roots: list[Path]) -> bool:
    return any(p == r or r in p.parents for r in (root.resolve() for root in roots))


def _link_out(top: Path, roots: list[Path]) -> Path | None:
    """The first entry under ``top`` that leads outside ``roots``, links followed (into linked directories
    too, each directory once)."""
    seen: set[Path] = set()
    todo = [top]
    while todo:
        folder = todo.pop()
        if folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        for entry in sorted(folder.iterdir()):
            real = entry.resolve()
            if not _inside(real, roots):
                return entry
            if real.is_dir():
                todo.append(entry)
    return None


class AdapterPool:
    def __init__(
        self,
        load: Callable[[str, Path], int],
        unload: Callable[[str], None],
        max_adapters: int,
        *,
        adapter_dir: Path | None = None,
        allowed_roots: list[Path] | None = None,
        clock: Callable[[], float] = time.monotonic,
        slot_wait_s: float = 30.0,
    ) -> None:
        if max_adapters < 1:
            raise PoolError("--max-adapters must be at least 1", "")
        self._load, self._unload = load, unload
        self.max_adapters = max_adapters
        self.adapter_dir = adapter_dir
        self.allowed_roots = list(allowed_roots or []) + ([adapter_dir] if adapter_dir else [])
        self._clock = clock
        self.slot_wait_s = slot_wait_s  # how long a load waits for an adapter in use to become idle
        self._lock = threading.Condition()
        self._entries: dict[str, PoolEntry] = {}
        self._loading: set[str] = set()
        self.stats = PoolStats()

    # -- queries -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def states(self) -> list[dict]:
        with self._lock:
            return [e.state() for e in self._entries.values()]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    # -- loading -------------------------------------------------------------------------------
    def add(self, name: str, path: str | Path, pinned: bool = False, trusted: bool = False,
            hold: bool = False) -> PoolEntry:
        """Load ``name`` from ``path`` (inside the allowed roots unless ``trusted``), evicting if needed.
        With ``hold`` the entry comes back with one reference taken, so it cannot be evicted before use."""
        check_name(name)
        p = Path(path).expanduser().resolve() if trusted else resolve_inside(path, self.allowed_roots)
        if trusted:
            self.allowed_roots.append(p)
        deadline = time.monotonic() + self.slot_wait_s
        with self._lock:
            while True:  # every wait releases the lock: look at the name again after each
                while name in self._loading:
                    self._lock.wait()
                if name in self._entries:
                    raise AlreadyLoaded(f"adapter {name!r} is already loaded", "unload it first", status=409)
                if self._make_room(deadline):
                    break
            self._loading.add(name)
        try:
            nbytes = self._load(name, p)
        except BaseException:
            with self._lock:
                self._loading.discard(name)
                self._lock.notify_all()
            raise
        with self._lock:
            self._loading.discard(name)
            entry = PoolEntry(name, p, pinned=pinned, refs=int(hold), nbytes=nbytes, loaded_at=self._clock(),
                              last_used=self._clock())
            self._entries[name] = entry
            self.stats.loads += 1
            self._lock.notify_all()
            return entry

    def register(self, name: str, path: Path, pinned: bool = False, nbytes: int = 0) -> PoolEntry:
        """Record an adapter the engine already loaded at start-up (e.g. vLLM's ``--lora-modules``)."""
        check_name(name)
        with self._lock:
            if name in self._entries:
                raise AlreadyLoaded(f"adapter {name!r} is already loaded", "unload it first", status=409)
            if len(self._entries) >= self.max_adapters:
                raise PoolError(f"more start-up adapters than --max-adapters {self.max_adapters}",
                                "raise --max-adapters", status=400)
            p = Path(path).resolve()
            self.allowed_roots.append(p)
            entry = PoolEntry(name, p, pinned=pinned, nbytes=nbytes, loaded_at=self._clock(),
                              last_used=self._clock())
            self._entries[name] = entry
            self.stats.loads += 1
            return entry

    def _make_room(self, deadline: float) -> bool:
        """Evict LRU idle unpinned adapters until one slot is free (lock held): True. When every slot is in
        use, wait once for a request to finish and return False, since the lock was released meanwhile and
        the caller must look again; past ``deadline``, or with only pinned adapters, fail (503)."""
        while len(self._entries) + len(self._loading) >= self.max_adapters:
            idle = [e for e in self._entries.values() if not e.pinned and e.refs == 0]
            if not idle:
                evictable_later = any(not e.pinned for e in self._entries.values()) or self._loading
                left = deadline - time.monotonic()
                if evictable_later and left > 0:
                    self._lock.wait(timeout=left)
                    return False
                pinned = sorted(e.name for e in self._entries.values() if e.pinned)
                if not evictable_later:  # no request finishing frees a slot: retrying cannot help
                    raise PoolError(f"all {self.max_adapters} adapter slots hold pinned adapters "
                                    f"({', '.join(pinned)}), so no other adapter can be loaded",
                                    "unload one (DELETE /v1/adapters/NAME), or restart with a larger "
                                    "--max-adapters or with --no-pin", status=409)
                raise PoolError(f"all {self.max_adapters} adapter slots are in use by requests"
                                + (f" or pinned ({', '.join(pinned)})" if pinned else ""),
                                "retry when a request finishes, or raise --max-adapters", status=503)
            victim = min(idle, key=lambda e: e.last_used)
            del self._entries[victim.name]
            self._evict(victim.name)
            self.stats.evictions += 1
        return True

    def _evict(self, name: str) -> None:
        """Unload an evicted (or removed) adapter from the engine. When the engine does not confirm it (vLLM's
        connection dropped), the request that needed the slot still goes on: the slot is free in the pool, and
        the engine's stale copy is replaced when the name is loaded again (the backend's load replaces in place)."""
        try:
            self._unload(name)
        except Exception as e:  # noqa: BLE001 - the eviction stands; the engine's copy is replaced on reload
            log.warning("adapter %s evicted, but the engine did not confirm its unload: %s", name, e)

    def remove(self, name: str) -> None:
        """Unload ``name``; refused (409) while requests use it."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise PoolError(f"adapter {name!r} is not loaded", "", status=404)
            if entry.refs:
                raise PoolError(f"adapter {name!r} is in use by {entry.refs} request(s)", "retry later", status=409)
            del self._entries[name]
            self._evict(name)

    def forget(self, name: str) -> None:
        """Drop ``name`` without unloading it: the engine no longer holds it (it restarted without it)."""
        with self._lock:
            self._entries.pop(name, None)
            self._lock.notify_all()

    def try_hold(self, name: str) -> PoolEntry | None:
        """Take a reference on ``name`` if it is loaded (no waiting, no loading); release it with
        :meth:`release`."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                entry.refs += 1
                entry.hits += 1
                self.stats.hits += 1
            return entry

    def release(self, entry: PoolEntry) -> None:
        with self._lock:
            entry.refs -= 1
            entry.last_used = self._clock()
            self._lock.notify_all()

    def on_demand(self, name: str) -> Path | None:
        """``adapter_dir/<name>`` when it holds an adapter (a PEFT config or a GGUF file), else None."""
        candidate = self.adapter_dir / name if self.adapter_dir else None
        if candidate is None or not (candidate / "adapter_config.json").exists() and not any(
                candidate.glob("*.gguf") if candidate.is_dir() else []):
            return None
        return candidate

    def check_known(self, name: str) -> None:
        """Refuse (404) a name that is neither loaded, nor loading, nor loadable on demand: a stat or two, no load."""
        with self._lock:
            if name in self._entries or name in self._loading:
                return
        if self.on_demand(check_name(name)) is None:
            raise PoolError(f"adapter {name!r} is not loaded", "load it first (POST /v1/adapters)", status=404)

    @contextmanager
    def use(self, name: str) -> Iterator[PoolEntry]:
        """Hold ``name`` for one request (loading it from ``adapter_dir`` on demand)."""
        check_name(name)
        entry = self.try_hold(name)
        if entry is None:
            self.stats.misses += 1
            candidate = self.on_demand(name)
            if candidate is None:
                raise PoolError(f"adapter {name!r} is not loaded", "load it first (POST /v1/adapters)", status=404)
            try:
                entry = self.add(name, candidate, hold=True)
            except AlreadyLoaded as e:
                entry = self.try_hold(name)  # another request loaded it meanwhile
                if entry is None:
                    raise PoolError(f"adapter {name!r} was evicted while loading", "retry", status=503) from e
        try:
            yield entry
        finally:
            self.release(entry)
