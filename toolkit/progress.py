"""Rich progress on stderr for long work; silent when stderr is not a terminal or in --json mode."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

stderr = Console(stderr=True)
stdout = Console(highlight=False)  # what a command tells the user (the demo moves it to stderr for --json)


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


@contextlib.contextmanager
def working(label: str, enabled: bool = True) -> Iterator[None]:
    """A spinner with elapsed time for work that cannot count its progress (a download, a model build)."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=stderr,
                  transient=True) as bar:
        bar.add_task(label, total=None)
        yield


@contextlib.contextmanager
def step_progress(label: str, enabled: bool = True) -> Iterator:
    """Yield a ``(step, total, loss)`` callback that drives a bar of training steps."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), TextColumn("loss {task.fields[loss]}"), console=stderr, transient=True) as bar:
        task = bar.add_task(label, total=None, loss="-")

        def update(step: int, total: int, loss: float) -> None:
            bar.update(task, completed=step, total=total, loss=f"{loss:.3f}")

        yield update
