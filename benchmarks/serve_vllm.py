"""Gateway overhead on the vLLM engine: one request set sent straight to vLLM and through tuneport.

`tuneport serve --engine vllm` runs as its own process (gateway) with its vLLM child; the load generator
(this process, asyncio + httpx) sends the same mixed set (base + 3 adapters, greedy, fixed lengths) to
vLLM's port and to the gateway's port, alternating rounds. Direct requests name the same vLLM models the
gateway uses (base traffic through the guard's zero adapter where the CPU bug applies); a third row
sends base traffic to vLLM without the zero adapter, to show what the guard costs.
Run: python benchmarks/serve_vllm.py [--requests N] [--concurrency C] [--max-tokens T] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, table  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

from serve.vllm_bugs import GUARD_ADAPTER, bugs_that_apply  # noqa: E402
from toolkit.tiny import PROMPTS, TinyZoo  # noqa: E402

ADAPTERS = ("plain", "all_linear", "rslora")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_set(url: str, jobs: list[tuple[str, str]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    tokens = 0

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(model: str, prompt: str) -> None:
            nonlocal tokens
            async with sem:
                t = time.perf_counter()
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True})
                lat.append(time.perf_counter() - t)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(m, p) for m, p in jobs))
        wall = time.perf_counter() - start
    lat.sort()
    return {"tok_s": tokens / wall, "p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tuneport-bench-vllm-"))
    zoo = TinyZoo(work / "zoo")
    base = zoo.base("llama", wide=True)
    name = base.name
    gw_port, vllm_port = free_port(), free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TUNEPORT_CACHE_DIR": str(work / "cache")}
    cmd = [sys.executable, "-m", "toolkit.cli", "serve", "--engine", "vllm", "--base", str(base),
           "--port", str(gw_port), "--engine-port", str(vllm_port), "--dtype", "float32", "--max-model-len", "256",
           "--log-file", str(work / "vllm.log")]
    for a in ADAPTERS:
        cmd += ["--adapter", f"{a}={zoo.adapter('llama', a, wide=True)}"]
    cmd += ["--", "--enforce-eager", "--max-num-seqs", str(args.concurrency)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"tuneport serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{gw_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        guard = bool(bugs_that_apply())
        models = [name, *ADAPTERS]
        jobs = [(models[i % 4], PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
        upstream = {name: GUARD_ADAPTER if guard else name}
        direct_jobs = [(upstream.get(m, m), p) for m, p in jobs]
        gw, direct = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{vllm_port}"
        asyncio.run(run_set(gw, jobs[:8], args.concurrency, 4))  # warm-up: every adapter in a slot
        asyncio.run(run_set(direct, direct_jobs[:8], args.concurrency, 4))
        res: dict[str, list[dict]] = {"direct": [], "gateway": [], "direct-noguard": []}
        for _ in range(args.rounds):
            res["direct"].append(asyncio.run(run_set(direct, direct_jobs, args.concurrency, args.max_tokens)))
            res["gateway"].append(asyncio.run(run_set(gw, jobs, args.concurrency, args.max_tokens)))
            if guard:
                res["direct-noguard"].append(asyncio.run(run_set(direct, jobs, args.concurrency, args.max_tokens)))
    finally:
        proc.terminate()
        proc.wait(120)

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in res[key])

    base_tps = med("direct", "tok_s")
    rows = []
    labels = {"direct": "vLLM direct (same models)", "gateway": "through tuneport gateway",
              "direct-noguard": "vLLM direct, base without zero adapter"}
    for key, label in labels.items():
        if not res[key]:
            continue
        rows.append([label, f"{med(key, 'tok_s'):.1f}", f"{med(key, 'tok_s') / base_tps:.3f}x",
                     f"{med(key, 'p50') * 1000:.0f}", f"{med(key, 'p99') * 1000:.0f}",
                     " / ".join(f"{r['tok_s']:.1f}" for r in res[key])])
    print(f"machine: {machine()}")
    print(f"model: tiny llama hidden 256 (fp32), 3 adapters + base mixed; {args.requests} requests x "
          f"{args.max_tokens} tokens, concurrency {args.concurrency}; median of {args.rounds} alternating rounds; "
          f"guard {'on' if guard else 'off'}")
    print(table(rows, ["path", "tok/s", "ratio", "p50 ms", "p99 ms", "rounds tok/s"]))


if __name__ == "__main__":
    main()
