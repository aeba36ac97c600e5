"""Gateway overhead on the vLLM engine: one request set sent straight to vLLM and through tuneport.

`tuneport serve --engine vllm` runs as its own process (gateway) with its vLLM child; the load generator
(this process, asyncio + httpx) sends the same mixed set (base + 3 adapters, greedy, fixed lengths) to
vLLM's port and to the gateway's port, alternating rounds. Direct requests name the same vLLM models the
gateway uses (base traffic through the guard's zero adapter where the CPU bug applies); a third row
sends base traffic to vLLM without the zero adapter, to show what the guard costs.
Run: python benchmarks/serve_vllm.py [--requests N] [--concurrency C] [--max-tokens T] [--rounds R] [--small]
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
from serve_llamacpp import make_model  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

from tuneport.serve.engines.vllm import free_port  # noqa: E402
from tuneport.serve.http import wait_for_health  # noqa: E402
from tuneport.serve.vllm_bugs import GUARD_ADAPTER, bugs_that_apply  # noqa: E402

N_ADAPTERS = 3


async def run_set(url: str, jobs: list[tuple[str, list[int]]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    tokens = 0

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(model: str, prompt: list[int]) -> None:
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
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="the tiny test model instead of ~125M params")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tuneport-bench-vllm-"))
    if args.small:  # engine time per step is tiny: measures the Python around it
        from tuneport.toolkit.tiny import TinyZoo

        zoo = TinyZoo(work / "zoo")
        base = zoo.base("llama", wide=True)
        adapter_dirs = [zoo.adapter("llama", v, wide=True) for v in ("plain", "all_linear", "rslora")]
        model_desc = "tiny llama (hidden 256, fp32), 3 adapters (r 8-16)"
    else:
        base, adapter_dirs = make_model(work, N_ADAPTERS)  # ~125M-param llama, r=16 LoRAs on q/k/v/o
        model_desc = "llama ~125M params (hidden 768, 12 layers) run in fp32, 3 r=16 adapters"
    adapters = [d.name for d in adapter_dirs]
    name = base.name
    gw_port, vllm_port = free_port(), free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TUNEPORT_CACHE_DIR": str(work / "cache")}
    cmd = [sys.executable, "-m", "tuneport", "serve", "--engine", "vllm", "--base", str(base),
           "--port", str(gw_port), "--engine-port", str(vllm_port), "--dtype", "fp32", "--max-model-len", "256",
           "--log-file", str(work / "vllm.log")]
    for d in adapter_dirs:
        cmd += ["--adapter", f"{d.name}={d}"]
    cmd += ["--", "--enforce-eager", "--max-num-seqs", str(args.concurrency)]
    log = work / "tuneport.log"  # its access log too: a file, never a pipe that could fill and block it
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        if not wait_for_health(f"http://127.0.0.1:{gw_port}", 900, alive=lambda: proc.poll() is None):
            raise SystemExit(f"tuneport serve did not come up: {log.read_text()[-2000:]}")
        guard = bool(bugs_that_apply())
        models = [name, *adapters]
        jobs = [(models[i % len(models)], [1] + [100 + (i * 7 + j) % 300 for j in range(15)])
                for i in range(args.requests)]
        upstream = {name: GUARD_ADAPTER if guard else name}
        direct_jobs = [(upstream.get(m, m), p) for m, p in jobs]
        gw, direct = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{vllm_port}"
        asyncio.run(run_set(gw, jobs[:8], args.concurrency, 4))  # warm-up: every adapter in a slot
        asyncio.run(run_set(direct, direct_jobs[:8], args.concurrency, 4))
        import psutil

        gateway_proc = psutil.Process(proc.pid)
        procs = {"gateway": gateway_proc}
        for ch in gateway_proc.children(recursive=True):
            cmdline = " ".join(ch.cmdline())
            procs["vLLM API server" if "api_server" in cmdline else f"vLLM engine core {ch.pid}"] = ch

        def cpu() -> dict[str, float]:
            out = {}
            for k, p in procs.items():
                try:
                    t = p.cpu_times()
                    out[k] = t.user + t.system
                except psutil.Error:
                    out[k] = 0.0
            return out

        cpu_ms: dict[str, list[dict[str, float]]] = {}
        sets = {"direct": (direct, direct_jobs), "gateway": (gw, jobs)}
        if guard:
            sets["direct-noguard"] = (direct, jobs)
        res: dict[str, list[dict]] = {k: [] for k in sets}
        keys = list(sets)
        for r in range(args.rounds):  # the order rotates each round so that no path always goes first
            for key in keys[r % len(keys):] + keys[: r % len(keys)]:
                url, js = sets[key]
                before = cpu()
                res[key].append(asyncio.run(run_set(url, js, args.concurrency, args.max_tokens)))
                after = cpu()
                cpu_ms.setdefault(key, []).append({k: (after[k] - before[k]) * 1000 / len(js) for k in after})
    finally:
        proc.terminate()
        proc.wait(120)

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in res[key])

    base_tps = med("direct", "tok_s")
    rows = []
    labels = {"direct": "vLLM direct (same models)", "gateway": "through tuneport gateway",
              "direct-noguard": "vLLM direct, base as no adapter (unguarded)"}
    for key, label in labels.items():
        if not res[key]:
            continue
        rows.append([label, f"{med(key, 'tok_s'):.1f}", f"{med(key, 'tok_s') / base_tps:.3f}x",
                     f"{med(key, 'p50') * 1000:.0f}", f"{med(key, 'p99') * 1000:.0f}",
                     " / ".join(f"{r['tok_s']:.1f}" for r in res[key])])
    print(f"machine: {machine()}")
    print(f"model: {model_desc} + base mixed; {args.requests} requests x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}; median of {args.rounds} alternating rounds; "
          f"guard {'on' if guard else 'off'}")
    print(table(rows, ["path", "tok/s", "ratio", "p50 ms", "p99 ms", "rounds tok/s"]))
    # CPU time per request by process (robust to the timing noise of a small shared VM)
    names = list(cpu_ms["direct"][0])
    cpu_rows = [[labels[key], *(f"{statistics.median(r[n] for r in cpu_ms[key]):.1f}" for n in names)]
                for key in cpu_ms]
    print("CPU ms per request, by process (median over rounds):")
    print(table(cpu_rows, ["path", *names]))


if __name__ == "__main__":
    main()
