"""Serving benchmark (llama.cpp engine), side by side with llama.cpp's own llama-server in one run.

Models, generated with random weights and a SentencePiece tokenizer, each with 32 r=16 LoRAs on q/k/v/o:
``125m`` (hidden 768, 12 layers, vocab 32000) as Q8_0, and ``1b`` (TinyLlama's shape: hidden 2048, 22 layers,
32 heads / 4 KV heads) as Q4_K_M. Both servers run as separate processes over HTTP with every adapter loaded,
the same thread count (physical cores) and 8 sequences (llama-server: 8 slots).

Per model, concurrency (4, 8) and traffic (base only, one adapter, 8 and 32 adapters round robin): tokens/s,
p50 and p99 request latency, 32 tokens per request from distinct 16-token prompts (no prompt reuse).
Then time to first token with a shared 512-token system prompt: the first request (a miss) against the next
ones (same system prompt, a new question: a hit where the server caches prompts).

Run: python benchmarks/serve_llamacpp.py --llama-server .bench/llama-server/bin/llama-server
     [--models 125m,1b] [--requests 48] [--workdir .bench/serve] [--compare-contexts] [--compare-fallback]
     [--sets-sweep 2,4]
(benchmarks/build_llama_server.sh builds llama-server from the vendored source of the llama-cpp-python sdist.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import load_test, machine, table  # noqa: E402
from merge import llama_specs  # noqa: E402

# benchmarks/gguf.py would shadow the gguf package: drop this folder from the path again
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

from tuneport.convert.shards import ShardedSafetensorsWriter  # noqa: E402

R, N_ADAPTERS, SLOTS, N_CTX = 16, 32, 8, 1024


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv: int
    quant: str
    requests_scale: float = 1.0  # fewer requests where each is slow


MODELS = {"125m": ModelShape(768, 2048, 12, 12, 4, "q8_0"),
          "1b": ModelShape(2048, 5632, 22, 32, 4, "q4_k_m", 0.34)}
VOCAB = 32000


def make_model(root: Path, shape: ModelShape) -> tuple[Path, list[Path]]:
    from safetensors.torch import save_file

    from tuneport.toolkit.tiny.tokenizers import write_sentencepiece

    base = root / "base"
    base.mkdir(parents=True)
    specs = llama_specs(shape.hidden, shape.inter, shape.layers, shape.heads, shape.kv, VOCAB)
    w = ShardedSafetensorsWriter(base, specs)
    gen = torch.Generator().manual_seed(0)
    for s in specs:
        scale = 1.0 if s.name.endswith("norm.weight") else 0.02
        w.write(s.name, (torch.randn(s.shape, generator=gen) * scale).to(torch.bfloat16))
    w.close()
    (base / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.inter, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}))
    write_sentencepiece(base)
    adapters = []
    for i in range(N_ADAPTERS):
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


# -- the two servers, spoken to over HTTP ----------------------------------------------------------------
@dataclass
class Server:
    label: str
    url: str
    proc: subprocess.Popen
    path: str  # the completion route
    names: list[str]  # adapter names (llama-server: their ids as strings)
    base_name: str

    def body(self, prompt: list[int], adapter: str | None, max_tokens: int, stream: bool = False) -> dict:
        if self.label == "llama-server":
            lora = [{"id": int(adapter), "scale": 1.0}] if adapter is not None else []
            return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "lora": lora,
                    "stream": stream, "cache_prompt": True}
        return {"model": adapter or self.base_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    @staticmethod
    def tokens(label: str, answer: dict) -> int:
        return int(answer["tokens_predicted"]) if label == "llama-server" else int(answer["usage"]["completion_tokens"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    from tuneport.serve.http import wait_for_health

    if not wait_for_health(url, timeout, interval_s=0.2, alive=lambda: proc.poll() is None):
        raise RuntimeError(f"{url} did not come up")


GPU_LAYERS = {"gpu_layers": "0"}  # --gpu-layers: both servers' layers on the GPU ("all") or the CPU ("0")


def start_llama_server(binary: Path, model: Path, loras: list[Path], threads: int, port: int) -> Server:
    ngl = "999" if GPU_LAYERS["gpu_layers"] == "all" else GPU_LAYERS["gpu_layers"]  # every layer, output included
    proc = subprocess.Popen([str(binary), "-m", str(model), *sum((["--lora", str(p)] for p in loras), []),
                             "--lora-init-without-apply", "-np", str(SLOTS), "-c", str(N_CTX * SLOTS), "-t",
                             str(threads), "-tb", str(threads), "--port", str(port), "-ngl", ngl],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server("llama-server", f"http://127.0.0.1:{port}", proc, "/completion",
                    [str(i) for i in range(len(loras))], "")
    wait_http(server.url, proc)
    return server


def start_tuneport(model: Path, loras: list[Path], port: int, contexts: int | None = None,
                   fallback: bool = False, max_sets: int | None = None) -> Server:
    names = [p.stem.replace("-F32", "") for p in loras]
    proc = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--base", str(model),
                             *sum((["--adapter", f"{n}={p}"] for n, p in zip(names, loras, strict=True)), []),
                             "--max-adapters", str(len(loras)), "--port", str(port), "--n-ctx", str(N_CTX),
                             "--gpu-layers", GPU_LAYERS["gpu_layers"],
                             *(["--contexts", str(contexts)] if contexts else []),
                             *(["--max-sets-per-batch", str(max_sets)] if max_sets else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TUNEPORT_LLAMACPP_BATCH_ADAPTERS": "0"} if fallback else None)
    label = "tuneport serve" if contexts is None else f"tuneport serve, {contexts} context(s)"
    server = Server(label, f"http://127.0.0.1:{port}", proc, "/v1/completions", names, model.stem)
    wait_http(server.url, proc)
    return server


def traffic(server: Server, adapters: list[str | None], n: int, concurrency: int, max_tokens: int,
            offset: int) -> tuple[float, float, float]:
    """tokens/s, p50 and p99 latency of ``n`` requests, ``concurrency`` at a time, adapters round robin."""
    import httpx

    client = httpx.Client(base_url=server.url, timeout=1200)

    def one(k: int) -> int:
        prompt = [1] + [(offset + 97 * k + 13 * j) % (VOCAB - 100) + 50 for j in range(15)]  # distinct prompts
        r = client.post(server.path, json=server.body(prompt, adapters[k % len(adapters)], max_tokens))
        r.raise_for_status()
        return Server.tokens(server.label, r.json())

    return load_test(one, n, concurrency)


def first_token_s(server: Server, prompt: list[int], adapter: str | None) -> float:
    """Seconds from sending a streamed request to its first token."""
    import httpx

    t0 = time.perf_counter()
    with httpx.Client(base_url=server.url, timeout=600) as c, \
            c.stream("POST", server.path, json=server.body(prompt, adapter, 4, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def ttft(server: Server, adapter: str | None, questions: int = 4) -> tuple[float, float]:
    """Time to first token with a 512-token system prompt: the first request (a miss), then the median of the
    next ones (the same system prompt, a new question each)."""
    system = [1] + [(7 * j) % (VOCAB - 100) + 50 for j in range(511)]
    times = [first_token_s(server, system + [(31 * q + j) % 900 + 60 for j in range(16)], adapter)
             for q in range(questions + 1)]
    rest = sorted(times[1:])
    return times[0], rest[len(rest) // 2]


def bench_model(key: str, args, threads: int) -> tuple[list[list[str]], list[list[str]], list[list[str]], str]:
    import tuneport

    shape = MODELS[key]
    work = args.workdir.resolve() / key
    shutil.rmtree(work, ignore_errors=True)
    os.environ["TUNEPORT_CACHE_DIR"] = str(work / "cache")
    base, peft = make_model(work, shape)
    tuneport.export(base=base, adapters=[f"{p.name}={p}" for p in peft], target="gguf", adapter_mode="separate",
                    quant=shape.quant, out=work / "gguf")
    model = next((work / "gguf").glob(f"base-{shape.quant.upper()}.gguf"))
    loras = sorted((work / "gguf" / "adapters").glob("*.gguf"), key=lambda p: int(p.stem.split("-")[0][1:]))
    shutil.rmtree(work / "peft")
    shutil.rmtree(base)
    n = max(8, int(args.requests * shape.requests_scale))
    rows, ttft_rows = [], []
    results: dict[tuple, tuple] = {}
    # llama-server twice: with no LoRA loaded (its fastest base path: with LoRAs loaded, `"lora": []` was 3-4x
    # slower, measured), then with all 32 for the adapter traffic
    servers = [("llama-server, no LoRAs", lambda: start_llama_server(args.llama_server, model, [], threads, 18080)),
               ("llama-server", lambda: start_llama_server(args.llama_server, model, loras, threads, 18081))] \
        if args.llama_server else []
    servers.append(("tuneport serve", lambda: start_tuneport(model, loras, 18082)))
    if args.compare_contexts:  # one context for every adapter set against one per adapter set
        servers.append(("tuneport serve, 8 contexts", lambda: start_tuneport(model, loras, 18083, contexts=8)))
    if args.compare_fallback:  # per-sequence LoRA against the scheduler a stock llama-cpp-python gets
        servers.append(("tuneport serve, fallback", lambda: start_tuneport(model, loras, 18084, fallback=True)))
    for k in args.sets_sweep:  # per-sequence LoRA with at most k adapter sets in one batch
        servers.append((f"tuneport serve, max {k} sets",
                        lambda k=k: start_tuneport(model, loras, 18090 + k, max_sets=k)))
    for label, start in servers:
        server = start()
        try:
            mixes = {"base only": [None], "1 adapter": server.names[:1], "8 adapters": server.names[:8],
                     "32 adapters": server.names[:32]} if server.names else {"base only": [None]}
            traffic(server, [None], 4, 4, 8, offset=0)  # warm-up
            for conc in args.concurrency:
                for mix, adapters in mixes.items():
                    results[(label, conc, mix)] = traffic(server, adapters, n, conc, args.max_tokens,
                                                          offset=1000 * conc + len(mix))
            for adapter in (None, server.names[0]) if server.names else ():
                miss, hit = ttft(server, adapter)
                ttft_rows.append([label, "base" if adapter is None else "adapter", f"{miss:.3f}", f"{hit:.3f}",
                                  f"{hit / miss:.2f}x"])
        finally:
            server.stop()
    for conc in args.concurrency:
        for mix in ("base only", "1 adapter", "8 adapters", "32 adapters"):
            tp = results[("tuneport serve", conc, mix)]
            base_tp = results[("tuneport serve", conc, "base only")][0]
            ls = results.get(("llama-server, no LoRAs" if mix == "base only" else "llama-server", conc, mix))
            rows.append([key, str(conc), mix, f"{tp[0]:.1f}", f"{ls[0]:.1f}" if ls else "-",
                         f"{tp[0] / ls[0]:.2f}x" if ls else "-", f"{tp[0] / base_tp:.2f}x",
                         f"{tp[2] / tp[1]:.2f}", f"{ls[2] / ls[1]:.2f}" if ls else "-"])
    base_rows = [[key, str(conc), f"{results[('llama-server, no LoRAs', conc, 'base only')][0]:.1f}",
                  f"{results[('llama-server', conc, 'base only')][0]:.1f}"]
                 for conc in args.concurrency] if args.llama_server else []
    loops = [[key, str(conc), mix, f"{results[('tuneport serve', conc, mix)][0]:.1f}",
              f"{results[('tuneport serve, 8 contexts', conc, mix)][0]:.1f}"]
             for conc in args.concurrency for mix in ("base only", "1 adapter", "8 adapters", "32 adapters")] \
        if args.compare_contexts else []
    fallback = []
    for conc in args.concurrency if args.compare_fallback else ():
        for mix in ("base only", "1 adapter", "8 adapters", "32 adapters"):
            ours = results[("tuneport serve", conc, mix)][0]
            theirs = results[("tuneport serve, fallback", conc, mix)][0]
            fallback.append(["fallback", key, str(conc), mix, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x"])
    for conc in args.concurrency:
        for k in args.sets_sweep:
            for mix in ("8 adapters", "32 adapters"):
                tp = results[(f"tuneport serve, max {k} sets", conc, mix)]
                fallback.append(["sets", key, str(conc), mix, str(k), f"{tp[0]:.1f}",
                                 f"{results[('tuneport serve', conc, mix)][0]:.1f}", f"{tp[2] / tp[1]:.2f}"])
    size = f"{model.stat().st_size / 2**20:.0f} MiB {shape.quant.upper()}, 32 LoRAs r={R} on q/k/v/o, {n} requests"
    return rows, ttft_rows, loops + [["llama-server base", *r] for r in base_rows] + fallback, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/serve"))
    ap.add_argument("--models", default="125m,1b")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--llama-server", type=Path, help="llama-server binary for the side-by-side comparison")
    ap.add_argument("--compare-contexts", action="store_true", help="also run tuneport serve --contexts 8")
    ap.add_argument("--compare-fallback", action="store_true",
                    help="also run tuneport serve with one adapter set per decode (a stock llama-cpp-python's path)")
    ap.add_argument("--sets-sweep", default="", help="also run tuneport serve --max-sets-per-batch K for each K "
                    "(comma-separated): how the default was chosen")
    ap.add_argument("--gpu-layers", default="0", help="both servers: 'all' (llama-server -ngl 999) or a count")
    ap.add_argument("--json-out", type=Path, help="also write the tables as JSON here")
    args = ap.parse_args()
    GPU_LAYERS["gpu_layers"] = args.gpu_layers
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.sets_sweep = [int(k) for k in args.sets_sweep.split(",") if k]
    if args.llama_server:
        args.llama_server = args.llama_server.resolve()
    from tuneport.serve.engines.llamacpp import physical_cores
    from tuneport.serve.engines.llamacpp_state import DEFAULT_MAX_SETS_PER_BATCH

    threads = physical_cores()
    all_rows, all_ttft, all_loops, sizes = [], [], [], []
    for key in args.models.split(","):
        rows, ttft_rows, loops, size = bench_model(key, args, threads)
        all_rows += rows
        all_loops += loops
        all_ttft += [[key, *r] for r in ttft_rows]
        sizes.append(f"{key}: {size}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"machine": machine(), "gpu_layers": args.gpu_layers, "rows": all_rows,
                                             "ttft": all_ttft, "contexts": all_loops, "sizes": sizes}, indent=1))
    print(f"machine: {machine()}; {threads} threads per server (physical cores), {SLOTS} sequences, "
          f"--gpu-layers {args.gpu_layers}")
    print("\n".join(sizes) + f"; {args.max_tokens} tokens per request\n")
    print(table(all_rows, ["model", "conc", "traffic", "tuneport tok/s", "llama-server tok/s", "vs llama-server",
                           "vs own base-only", "tuneport p99/p50", "llama-server p99/p50"]))
    print("\ntime to first token, 512-token shared system prompt (s):\n")
    print(table(all_ttft, ["model", "server", "traffic", "first (miss)", "next (hit)", "hit/miss"]))
    loops = [r for r in all_loops if r[0] not in ("llama-server base", "fallback", "sets")]
    if loops:
        print("\none context for every adapter set (the default) against up to 8 (one per adapter set), tokens/s:\n")
        print(table(loops, ["model", "conc", "traffic", "--contexts 1", "--contexts 8"]))
    fallback = [r[1:] for r in all_loops if r[0] == "fallback"]
    if fallback:
        print("\nper-sequence LoRA (every adapter set in one batch) against the fallback (one set per decode), "
              "tokens/s:\n")
        print(table(fallback, ["model", "conc", "traffic", "per-sequence", "fallback", "ratio"]))
    sets = [r[1:] for r in all_loops if r[0] == "sets"]
    if sets:
        print(f"\n--max-sets-per-batch K against the default ({DEFAULT_MAX_SETS_PER_BATCH}), tokens/s:\n")
        print(table(sets, ["model", "conc", "traffic", "K", "tok/s at K", "tok/s default", "p99/p50 at K"]))
    base = [r[1:] for r in all_loops if r[0] == "llama-server base"]
    if base:
        print("\nllama-server base-only tokens/s: no LoRA loaded (the baseline above) against 32 loaded, lora: []\n")
        print(table(base, ["model", "conc", "no LoRAs", "32 LoRAs loaded"]))


if __name__ == "__main__":
    main()
