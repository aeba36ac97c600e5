"""The soak of benchmarks/soak.py for 60 seconds per engine: `tuneport serve` in its own process, mixed
traffic at concurrency 16 (completions and chat, streamed and not, base / pinned / on-demand / runtime
adapters) with adapter churn (admin loads and unloads, on-demand loads evicting at --max-adapters 5).
Every answer equals a fresh single-adapter instance's greedy tokens, nothing answers a status docs/serve.md
does not list for churn, RSS stays flat after warm-up and /metrics adds up. The 10-minute run and its figures
are in docs/benchmarks.md ("Soak")."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

SOAK_S = 60
WARMUP_S = 30


def soak_module():
    """benchmarks/soak.py, imported by path (benchmarks/ on sys.path would shadow the gguf package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("tuneport_benchmark_soak", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("engine", [pytest.param("llamacpp", marks=[pytest.mark.llamacpp, pytest.mark.slow]),
                                    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])])
def test_soak_60s(engine, zoo, tmp_path):
    soak = soak_module()
    t = time.perf_counter()
    setup = soak.prepare(engine, tmp_path, zoo=zoo)
    prepared_s = time.perf_counter() - t
    r = soak.run_soak(setup, SOAK_S, concurrency=16, warmup_s=WARMUP_S)
    print(soak.table([soak.row(r)], soak.HEADER), f"\nseconds: prepare {prepared_s:.1f}, then", r["phases_s"])
    assert r["wrong"] == 0, r["problems"]
    assert r["unexpected_5xx"] == 0 and r["unexpected_other"] == 0, r["problems"]
    assert r["metrics_consistent"], r["metrics_checks"]
    assert r["tracebacks"] == 0 and r["exit_code"] == 0
    # the traffic was what it says: streamed and whole, chat and completions, churn with evictions
    assert r["answered"] > 200 and 0 < r["streamed"] < r["requests"] and r["chat"] > 0
    assert r["admin_loads"] > 5 and r["unloads"] > 0 and r["evictions"] > 5 and r["loads"] > r["admin_loads"]
    # The bar is 5% over ten minutes; in 45 s after a 15 s warm-up the server's allocator is still
    # settling (llama.cpp: +2.9% in a 60 s run whose 10-minute run stays under 5%), so the bound is the same
    # 5% here, and the 10-minute run in docs/benchmarks.md shows the trend.
    assert r["rss_growth_pct"] < 5, r["samples"]
