"""``tuneport serve --on ray`` against ``tuneport serve`` direct: the same llama.cpp engine, the same traffic.

Model: the 125M shape of benchmarks/serve_llamacpp.py (random weights, Q8_0 GGUF) with 8 r=16 LoRAs on q/k/v/o,
loaded on demand from an adapter directory. Traffic: 8 adapters round robin plus base requests, concurrency 8,
32 tokens per request from distinct 16-token prompts. Rows:

- ``direct``: ``tuneport serve`` in this process (its gateway on uvicorn), all cores to one llama.cpp;
- ``ray, 1 replica``: the Ray Serve application (ingress -> replica), the replica reserving every core;
- ``ray, 2 replicas``: two replicas, each reserving half the cores (multiplexed: each adapter routed to a replica
  that holds it).

Each row twice: whole answers and streamed ones (a server-sent event per token). Printed: tokens/s, p50/p99
latency, the ratio to ``direct``, adapter loads so far. On 2 cores the 2-replica row measures
what splitting the cores costs, not scale-out: a second machine is where the second replica earns its keep.

Run: python benchmarks/serve_ray.py [--requests 192] [--workdir .bench/ray]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import load_test, machine, table  # noqa: E402
from serve_llamacpp import MODELS, VOCAB, make_model  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

import tuneport  # noqa: E402

N_ADAPTERS, MAX_TOKENS, CONCURRENCY = 8, 32, 8


def prepare(work: Path) -> tuple[Path, Path, list[str]]:
    """The GGUF base and an adapter directory of GGUF LoRAs (built once)."""
    gguf, adapter_dir = work / "gguf", work / "adapters"
    if not adapter_dir.exists():
        base, peft = make_model(work / "hf", MODELS["125m"])
        peft = peft[:N_ADAPTERS]
        tuneport.export(base=base, adapters=[f"a{i}={p}" for i, p in enumerate(peft)], target="gguf",
                        adapter_mode="separate", quant="q8_0", out=gguf)
        for i in range(N_ADAPTERS):
            (adapter_dir / f"a{i}").mkdir(parents=True)
            lora = next((gguf / "adapters").glob(f"a{i}-*.gguf"))
            shutil.copy(lora, adapter_dir / f"a{i}" / lora.name)
    model = next(p for p in gguf.glob("*.gguf"))
    return model, adapter_dir, [f"a{i}" for i in range(N_ADAPTERS)]


def traffic(url: str, base: str, names: list[str], n: int, stream: bool) -> tuple[float, float, float]:
    """tokens/s, p50 and p99 latency of ``n`` requests (adapters round robin, every 9th the base); streamed: each
    token its own server-sent event."""
    models = [*names, base]
    client = httpx.Client(base_url=url, timeout=1200)

    def one(k: int) -> int:
        prompt = [1] + [(97 * k + 13 * j) % (VOCAB - 100) + 50 for j in range(15)]
        body = {"model": models[k % len(models)], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if not stream:
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return MAX_TOKENS  # ignore_eos: every answer is MAX_TOKENS long

    for k in range(len(models)):  # every adapter loaded once before timing
        one(k)
    return load_test(one, n, CONCURRENCY)


def adapter_loads(url: str) -> int:
    text = httpx.get(f"{url}/metrics").text
    return next(int(line.split()[-1]) for line in text.splitlines() if line.startswith("tuneport_adapter_loads_total"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/ray"))
    args = ap.parse_args()
    import ray

    model, adapter_dir, names = prepare(args.workdir)
    cores = os.cpu_count() or 1
    common = dict(base=model, adapter_dir=adapter_dir, engine="llamacpp", max_adapters=N_ADAPTERS, port=0,
                  n_ctx=1024)
    rows, direct = [], {}
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        for label, extra in [("direct", {}), ("ray, 1 replica", {"on": "ray", "cpus_per_replica": cores}),
                             ("ray, 2 replicas", {"on": "ray", "replicas": 2, "cpus_per_replica": cores / 2})]:
            with tuneport.serve(**common, **extra) as server:
                if extra:
                    time.sleep(2)  # the replicas' first reports
                for stream in (False, True):
                    tps, p50, p99 = traffic(server.url, model.stem, names, args.requests, stream)
                    time.sleep(1.5)
                    direct.setdefault(stream, tps)
                    rows.append([label, "streamed" if stream else "whole", f"{tps:.1f}", f"{p50:.2f}", f"{p99:.2f}",
                                 f"{tps / direct[stream]:.2f}x", str(adapter_loads(server.url))])
                    print(rows[-1], flush=True)
    finally:
        ray.shutdown()
    print(f"\n{machine()}; {args.requests} requests x {MAX_TOKENS} tokens, concurrency {CONCURRENCY}, "
          f"{N_ADAPTERS} adapters + base round robin; 125M Q8_0\n")
    print(table(rows, ["server", "answers", "tokens/s", "p50 s", "p99 s", "vs direct", "adapter loads"]))


if __name__ == "__main__":
    main()
