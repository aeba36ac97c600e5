"""Shared helpers for benchmarks: run a measured child process, print a table."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

CHILD_PRELUDE = (
    "import json, resource, sys, time\n"
    "t0 = time.perf_counter()\n"
)
# VmHWM, not ru_maxrss: ru_maxrss keeps the parent's high-water mark across fork + exec.
CHILD_EPILOGUE = (
    "\n_hwm = [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')][0]\n"
    "print('@@BENCH@@' + json.dumps({'inner_s': time.perf_counter() - t0, "
    "'peak_rss_mb': _hwm / 1024, **globals().get('EXTRA', {})}))\n"
)


def run_python(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; return its wall time, inner time and peak RSS."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + code + CHILD_EPILOGUE],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@BENCH@@"))
    return {"wall_s": wall, **json.loads(line[len("@@BENCH@@"):])}


def run_cmd(cmd: list[str] | str, shell: bool = False) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, shell=shell)
    return time.perf_counter() - start


def machine() -> str:
    import os

    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    py = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {py}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def load_test(one: Callable[[int], int], n: int, concurrency: int) -> tuple[float, float, float]:
    """Tokens/s, p50 and p99 latency of ``one(k)`` for k < ``n``, ``concurrency`` at a time (``one`` sends request
    k and returns its completion tokens)."""
    lat: list[float] = []
    lock = threading.Lock()

    def timed(k: int) -> int:
        t0 = time.perf_counter()
        tokens = one(k)
        with lock:
            lat.append(time.perf_counter() - t0)
        return tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(timed, range(n)))
    wall = time.perf_counter() - t0
    lat.sort()
    return total / wall, lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
