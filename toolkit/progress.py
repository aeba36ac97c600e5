"""Rich progress on stderr for long work; silent when stderr is not a terminal or in --json mode."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

stderr = Console(stderr=True)


@contextlib.contextmanager
def byte_progress(label: str, enabled: bool = True) -> Iterator:
    """Yield a ``(done, total, name)`` callback that drives a progress bar."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"), console=stderr, transient=True,
    ) as bar:
        task = bar.add_task(label, total=None, tensor="")

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, tensor=name[-48:])

        yield update
