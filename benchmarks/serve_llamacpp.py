"""Serving benchmark (llama.cpp engine): mixed-adapter throughput vs base-only, hot-load latency, memory.

A generated ~125M-parameter llama (hidden 768, 12 layers, vocab 32000, random weights, SentencePiece
tokenizer) exported to GGUF Q8_0 with 32 r=16 LoRAs, served by tuneport's engine in this process.
With --llama-server BIN (built by benchmarks/build_llama_server.sh) the same HTTP traffic also goes to
`tuneport serve` and to llama.cpp's own llama-server (8 LoRAs preloaded, per-request `lora` list), both
as separate processes, side by side.
Run: python benchmarks/serve_llamacpp.py [--workdir DIR] [--requests N] [--concurrency C] [--llama-server BIN]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, table  # noqa: E402
from merge import llama_specs  # noqa: E402

# benchmarks/gguf.py would shadow the gguf package: drop this folder from the path again
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

from tuneport.convert.io import ShardedSafetensorsWriter  # noqa: E402

H, INTER, LAYERS, HEADS, KV, VOCAB, R = 768, 2048, 12, 12, 4, 32000, 16


def rss_mb() -> float:
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1]) / 1024


def make_model(root: Path, n_adapters: int) -> tuple[Path, list[Path]]:
    from safetensors.torch import save_file

    from tuneport.toolkit.tiny.tokenizers import write_sentencepiece

    base = root / "base"
    base.mkdir(parents=True)
    specs = llama_specs(H, INTER, LAYERS, HEADS, KV, VOCAB)
    w = ShardedSafetensorsWriter(base, specs)
    gen = torch.Generator().manual_seed(0)
    for s in specs:
        scale = 1.0 if s.name.endswith("norm.weight") else 0.02
        w.write(s.name, (torch.randn(s.shape, generator=gen) * scale).to(torch.bfloat16))
    w.close()
    (base / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV, "vocab_size": VOCAB,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}))
    write_sentencepiece(base)
    adapters = []
    for i in range(n_adapters):
        d = root / "peft" / f"a{i}"
        d.mkdir(parents=True)
        tensors = {}
        for s in specs:
            if s.name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
                m = "base_model.model." + s.name[: -len(".weight")]
                tensors[f"{m}.lora_A.weight"] = torch.randn((R, s.shape[1]), generator=gen) * 0.01
                tensors[f"{m}.lora_B.weight"] = torch.randn((s.shape[0], R), generator=gen) * 0.01
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": R, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "bias": "none"}))
        adapters.append(d)
    return base, adapters


def run_traffic(engine, names: list[str | None], n_requests: int, concurrency: int, max_tokens: int):
    from tuneport.serve.engines.llamacpp import GenerationRequest

    prompt = [1] + [100 + i for i in range(15)]
    lat: list[float] = []
    lock = threading.Lock()

    def one(k: int) -> int:
        name = names[k % len(names)]
        t0 = time.perf_counter()
        toks = list(engine.generate(GenerationRequest(prompt, {name: 1.0} if name else {}, max_tokens=max_tokens,
                                                      ignore_eos=True)))
        with lock:
            lat.append(time.perf_counter() - t0)
        return len(toks)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(one, range(n_requests)))
    wall = time.perf_counter() - t0
    lat.sort()
    return total / wall, lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def http_traffic(url: str, bodies: list[dict], path: str, concurrency: int, count_key) -> tuple[float, float, float]:
    import httpx

    lat: list[float] = []
    lock = threading.Lock()
    client = httpx.Client(base_url=url, timeout=600)

    def one(body: dict) -> int:
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        r.raise_for_status()
        with lock:
            lat.append(time.perf_counter() - t0)
        return count_key(r.json())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        total = sum(ex.map(one, bodies))
    wall = time.perf_counter() - t0
    lat.sort()
    return total / wall, lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def wait_http(url: str, timeout: float = 120) -> None:
    from tuneport.serve.http import wait_for_health

    if not wait_for_health(url, timeout, interval_s=0.2):
        raise RuntimeError(f"{url} did not come up")


def compare_servers(model: Path, loras: list[Path], llama_server: Path, args) -> list[list[str]]:
    import subprocess

    names = [p.stem.replace("-F32", "") for p in loras[:8]]
    prompt = [1] + [100 + i for i in range(15)]
    n, conc, mt = args.requests, args.concurrency, args.max_tokens
    rows = []
    ls = subprocess.Popen([str(llama_server), "-m", str(model), *sum((["--lora", str(p)] for p in loras[:8]), []),
                           "--lora-init-without-apply", "-np", str(conc), "-c", str(256 * conc), "-t",
                           str(os.cpu_count()), "--port", "18081", "-ngl", "0"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http("http://127.0.0.1:18081")
        base = [{"prompt": prompt, "n_predict": mt, "temperature": 0, "ignore_eos": True, "lora": []}] * n
        mixed = [{"prompt": prompt, "n_predict": mt, "temperature": 0, "ignore_eos": True,
                  "lora": [{"id": k % 8, "scale": 1.0}]} for k in range(n)]
        for label, bodies in (("base only", base), ("8 adapters, round robin", mixed)):
            http_traffic("http://127.0.0.1:18081", bodies[:conc], "/completion", conc, lambda r: 0)  # warm-up
            tps, p50, p99 = http_traffic("http://127.0.0.1:18081", bodies, "/completion", conc,
                                         lambda r: int(r.get("tokens_predicted", 0)))
            rows.append([f"llama-server: {label}", f"{tps:.1f}", f"{p50:.2f}", f"{p99:.2f}", f"{p99 / p50:.2f}"])
    finally:
        ls.terminate()
        ls.wait()
    tp = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--base", str(model),
                           *sum((["--adapter", f"{nm}={p}"] for nm, p in zip(names, loras[:8], strict=True)), []),
                           "--port", "18082", "--n-ctx", "256", "--workers", "2"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http("http://127.0.0.1:18082")
        base = [{"model": model.stem, "prompt": prompt, "max_tokens": mt, "temperature": 0, "ignore_eos": True}] * n
        mixed = [{"model": names[k % 8], "prompt": prompt, "max_tokens": mt, "temperature": 0, "ignore_eos": True}
                 for k in range(n)]
        for label, bodies in (("base only", base), ("8 adapters, round robin", mixed)):
            http_traffic("http://127.0.0.1:18082", bodies[:conc], "/v1/completions", conc, lambda r: 0)
            tps, p50, p99 = http_traffic("http://127.0.0.1:18082", bodies, "/v1/completions", conc,
                                         lambda r: int(r["usage"]["completion_tokens"]))
            rows.append([f"tuneport serve: {label}", f"{tps:.1f}", f"{p50:.2f}", f"{p99:.2f}", f"{p99 / p50:.2f}"])
    finally:
        tp.terminate()
        tp.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/serve"))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--llama-server", type=Path, help="llama-server binary for the side-by-side comparison")
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    os.environ["TUNEPORT_CACHE_DIR"] = str(work / "cache")
    import tuneport
    from tuneport.serve.engines.llamacpp import LlamaCppEngine

    base, peft = make_model(work, 32)
    tuneport.export(base=base, adapters=[f"{p.name}={p}" for p in peft], target="gguf", adapter_mode="separate",
                    quant="q8_0", out=work / "gguf")
    model = work / "gguf" / "base-Q8_0.gguf"
    loras = sorted((work / "gguf" / "adapters").glob("*.gguf"))
    rss0 = rss_mb()
    engine = LlamaCppEngine(model, n_ctx=256, n_workers=2, n_seq_max=8)
    rss_model = rss_mb() - rss0
    load_ms = []
    for p in loras:
        t0 = time.perf_counter()
        engine.load_adapter(p.stem.replace("-F32", ""), p)
        load_ms.append((time.perf_counter() - t0) * 1000)
    rss_pool = rss_mb() - rss0
    lora_bytes = sum(p.stat().st_size for p in loras) / 2**20
    names = [p.stem.replace("-F32", "") for p in loras]
    rows = []
    base_tps, _, _ = run_traffic(engine, [None], args.requests, args.concurrency, args.max_tokens)  # warm-up
    base_tps, b50, b99 = run_traffic(engine, [None], args.requests, args.concurrency, args.max_tokens)
    rows.append(["base only", f"{base_tps:.1f}", "1.00x", f"{b50:.2f}", f"{b99:.2f}", f"{b99 / b50:.2f}"])
    for k in (1, 8, 32):
        tps, p50, p99 = run_traffic(engine, names[:k], args.requests, args.concurrency, args.max_tokens)
        label = "1 adapter (all traffic)" if k == 1 else f"{k} adapters, round robin"
        rows.append([label, f"{tps:.1f}", f"{tps / base_tps:.2f}x", f"{p50:.2f}", f"{p99:.2f}", f"{p99 / p50:.2f}"])
    engine.close()
    load_ms.sort()
    server_rows = compare_servers(model, loras, args.llama_server.resolve(), args) if args.llama_server else []
    print(f"machine: {machine()}")
    print(f"model: ~125M params Q8_0 ({model.stat().st_size / 2**20:.0f} MiB); 32 LoRAs r={R} on q/k/v/o "
          f"({lora_bytes:.1f} MiB); concurrency {args.concurrency}, "
          f"{args.requests} requests x {args.max_tokens} tokens\n")
    print(table(rows, ["traffic", "tokens/s", "vs base-only", "p50 s", "p99 s", "p99/p50"]))
    print(f"\nhot-load latency over {len(load_ms)} adapters: p50 {load_ms[len(load_ms) // 2]:.1f} ms, "
          f"p99 {load_ms[-1]:.1f} ms")
    print(f"memory: model {rss_model:.0f} MB; model + 32 adapters {rss_pool:.0f} MB "
          f"(adapters on disk {lora_bytes:.1f} MB; budget base + adapters + 10% = "
          f"{1.1 * (rss_model + lora_bytes):.0f} MB); 32 processes each holding a merged model ~ "
          f"{32 * rss_model:.0f} MB")
    if server_rows:
        print(f"\nHTTP, separate processes, concurrency {args.concurrency}, {args.requests} requests x "
              f"{args.max_tokens} tokens:\n")
        print(table(server_rows, ["server: traffic", "tokens/s", "p50 s", "p99 s", "p99/p50"]))


if __name__ == "__main__":
    main()
