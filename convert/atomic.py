"""Atomic output: a result is written to a temporary sibling, fsynced and renamed, so the final path holds a
whole result or nothing (a killed run's temporaries are removed by the next one)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import UserError

TMP_PREFIX = ".tuneport-tmp-"
NAME_MAX = 255  # bytes in a file name on Linux and macOS file systems
FSYNC_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuneport-fsync")
atexit.register(FSYNC_POOL.shutdown, wait=False)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` at ``path`` through a temporary sibling and a rename: never half a file there."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
