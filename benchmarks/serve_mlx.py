"""Serving benchmark (MLX engine): mixed-adapter HTTP traffic through `tuneport serve --engine mlx` and through
mlx-lm's own server (`python -m mlx_lm server`), side by side in one run.

A generated llama (default ~22M parameters: hidden 512, 8 layers, random weights, the tiny SentencePiece
tokenizer's 512 tokens) with r=16 LoRAs on q/k/v/o, exported once with `tuneport export --target mlx
--adapters separate`: both servers serve the same MLX directory and the same mlx-lm adapter directories.
mlx-lm's server names the adapter per request with `"adapters": PATH` and reloads the model whenever it
changes (and drains its batch first); tuneport keeps one base and decodes every adapter in one batch. Each
server runs as its own process; peak RSS is its VmHWM.
Run: python benchmarks/serve_mlx.py [--workdir DIR] [--requests N] [--concurrency C] [--adapters K]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, table  # noqa: E402
from serve_llamacpp import make_model  # noqa: E402  (removes this folder from sys.path again)

PROMPT = "The model writes"


def http_traffic(url: str, bodies: list[dict], concurrency: int) -> tuple[float, float, float, int]:
    """(tokens/s, p50 s, p99 s, tokens) for ``bodies`` sent ``concurrency`` at a time to /v1/completions."""
    import httpx

    lat: list[float] = []
    lock = threading.Lock()
    client = httpx.Client(base_url=url, timeout=1800)

    def one(body: dict) -> int:
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
        with lock:
            lat.append(time.perf_counter() - t0)
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(one, bodies))
    wall = time.perf_counter() - t0
    lat.sort()
    return total / wall, lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))], total


def peak_rss_mb(pid: int) -> float:
    return int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmHWM")).split()[1]) / 1024


def run_server(argv: list[str], url: str, traffic: list[tuple[str, list[dict]]], concurrency: int,
               log: Path) -> tuple[list[list[str]], float]:
    """Start a server, warm it up, send each traffic mix; rows per mix and the server's peak RSS (MB)."""
    from tuneport.serve.http import wait_for_health

    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        if not wait_for_health(url, 600, interval_s=0.2):
            raise RuntimeError(f"{argv[:4]} did not come up; see {log}")
        rows = []
        for label, bodies in traffic:
            http_traffic(url, bodies[:concurrency], concurrency)  # warm-up (compilation, first loads)
            tps, p50, p99, _ = http_traffic(url, bodies, concurrency)
            rows.append([label, tps, p50, p99])
        return rows, peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/serve-mlx"))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    os.environ["TUNEPORT_CACHE_DIR"] = str(work / "cache")
    import serve_llamacpp

    import tuneport
    from tuneport.toolkit.tiny.tokenizers import SP_VOCAB

    # a smaller llama than the llama.cpp benchmark's (mlx's CPU build is slow at matrix products), with
    # exactly the tokenizer's vocabulary: mlx-lm's detokenizer fails on ids the tokenizer lacks
    serve_llamacpp.H, serve_llamacpp.INTER, serve_llamacpp.LAYERS = args.hidden, args.hidden * 8 // 3 // 64 * 64, \
        args.layers
    serve_llamacpp.HEADS, serve_llamacpp.KV, serve_llamacpp.VOCAB = args.hidden // 64, max(1, args.hidden // 256), \
        SP_VOCAB
    base, peft = make_model(work, args.adapters)
    mlx_dir = work / "mlx"
    tuneport.export(base=base, adapters=[f"{p.name}={p}" for p in peft], target="mlx", adapter_mode="separate",
                    dtype="fp32", out=mlx_dir)
    names = [p.name for p in peft]
    adapter_dirs = {n: mlx_dir / "adapters" / n for n in names}
    n, conc, mt = args.requests, args.concurrency, args.max_tokens
    body = {"prompt": PROMPT, "max_tokens": mt, "temperature": 0}

    tp_traffic = [("base only", [{**body, "model": "mlx"}] * n),
                  (f"{len(names)} adapters, round robin", [{**body, "model": names[k % len(names)]} for k in range(n)])]
    tp_rows, tp_rss = run_server(
        [sys.executable, "-m", "tuneport", "serve", "--engine", "mlx", "--base", str(mlx_dir),
         *sum((["--adapter", f"{a}={p}"] for a, p in adapter_dirs.items()), []), "--port", "18091",
         "--n-ctx", "512"], "http://127.0.0.1:18091", tp_traffic, conc, work / "tuneport.log")

    ml_traffic = [("base only", [{**body, "model": "default_model"}] * n),
                  (f"{len(names)} adapters, round robin",
                   [{**body, "model": "default_model", "adapters": str(adapter_dirs[names[k % len(names)]])}
                    for k in range(n)])]
    ml_rows, ml_rss = run_server(
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_dir), "--port", "18092",
         "--decode-concurrency", str(conc), "--prompt-concurrency", str(conc)],
        "http://127.0.0.1:18092", ml_traffic, conc, work / "mlx_lm.log")

    rows = []
    for (label, tps, p50, p99), (_, btps, b50, b99) in zip(tp_rows, ml_rows, strict=True):
        rows.append([label, f"{tps:.1f}", f"{btps:.1f}", f"{tps / btps:.2f}x", f"{p50:.2f} / {b50:.2f}",
                     f"{p99:.2f} / {b99:.2f}"])
    print(f"machine: {machine()}")
    print(f"model: llama hidden {args.hidden}, {args.layers} layers, vocab {SP_VOCAB}, fp32 MLX "
          f"({sum(f.stat().st_size for f in mlx_dir.glob('model*.safetensors')) / 2**20:.0f} MiB); "
          f"{len(names)} LoRAs r=16 on q/k/v/o; concurrency {conc}, {n} requests x {mt} tokens, greedy\n")
    print(table(rows, ["traffic", "tuneport tok/s", "mlx_lm.server tok/s", "ratio", "p50 s (tp / mlx)",
                       "p99 s (tp / mlx)"]))
    print(f"\npeak RSS: tuneport serve {tp_rss:.0f} MB, mlx_lm.server {ml_rss:.0f} MB")


if __name__ == "__main__":
    main()
