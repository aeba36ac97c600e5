"""tuneport's cache: where it lives, and entries created once (a concurrent creator waits, then reuses)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TUNEPORT_CACHE_DIR", Path.home() / ".cache" / "tuneport"))


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
