"""Serving benchmark on a real chat model: SmolLM2-135M-Instruct Q8_0 with the demo's two LoRAs (pirate,
JSON), real chat prompts rendered by its chat template, greedy answers that stop at the model's EOS.

tuneport: `tuneport serve` (in-process llama.cpp engine behind the OpenAI gateway, one model, adapters
per request, up to --contexts contexts, 1 by default) driven over HTTP at concurrency C. Baseline, measured in
the same run: what a llama-cpp-python user writes: one `llama_cpp.Llama` per model (the LoRA given at load, as
llama-cpp-python requires), `create_chat_completion` called one request at a time (a `Llama` is not
thread-safe). Each side runs in a fresh process (peak RSS is its own). The model and adapters come from
the demo's cache (downloaded and trained on first use).
Run: python benchmarks/serve_real.py [--workdir DIR] [--rounds N] [--concurrency C] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, run_python, table  # noqa: E402

# benchmarks/gguf.py would shadow the gguf package: drop this folder from the path again
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

QUESTIONS = [
    "What is the tallest mountain in the world?", "What do plants need to grow?", "Name three primary colors.",
    "How do I make a cup of tea?", "What is the capital of England?", "Why is the sea salty?",
    "Give me a tip for staying focused.", "What is a good name for a dog?",
]

TUNEPORT = """
import httpx, tuneport
from concurrent.futures import ThreadPoolExecutor
jobs = {jobs!r}
with tuneport.serve(base={model!r}, adapters={loras!r}, engine='llamacpp', n_ctx=512, contexts={contexts}, port=0) as s:
    base = s.backend.name
    client = httpx.Client(base_url=s.url, timeout=600)
    def one(job):
        model, q = job
        t = time.perf_counter()
        r = client.post('/v1/chat/completions', json={{'model': model or base, 'temperature': 0,
                        'max_tokens': {max_tokens}, 'messages': [{{'role': 'user', 'content': q}}]}})
        r.raise_for_status()
        return r.json()['usage']['completion_tokens'], time.perf_counter() - t
    one(jobs[0])  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor({concurrency}) as ex:
        res = list(ex.map(one, jobs))
    wall = time.perf_counter() - t0
EXTRA = {{'tokens': sum(n for n, _ in res), 'wall': wall, 'lat': sorted(x for _, x in res)}}
"""

BASELINE = """
import llama_cpp
jobs = {jobs!r}
loras = {loras!r}
models = {{name: llama_cpp.Llama(model_path={model!r}, lora_path=loras.get(name), n_ctx=512, n_threads=2,
                                  verbose=False) for name in [None, *loras]}}
def one(job):
    model, q = job
    t = time.perf_counter()
    r = models[model].create_chat_completion(messages=[{{'role': 'user', 'content': q}}], temperature=0,
                                              max_tokens={max_tokens})
    return r['usage']['completion_tokens'], time.perf_counter() - t
one(jobs[0])  # warm-up
t0 = time.perf_counter()
done = []
for k in range(0, len(jobs), {concurrency}):  # requests arrive C at a time; the Llama answers them in turn
    wave_start = time.perf_counter()
    for job in jobs[k:k + {concurrency}]:
        n, _ = one(job)
        done.append((n, time.perf_counter() - wave_start))
wall = time.perf_counter() - t0
EXTRA = {{'tokens': sum(n for n, _ in done), 'wall': wall, 'lat': sorted(x for _, x in done)}}
"""


def prepare(work: Path) -> tuple[Path, dict[str, str]]:
    """The demo's base and adapters (cached), exported to GGUF Q8_0 with the adapters as GGUF LoRAs."""
    import tuneport
    from tuneport.toolkit.smollm.base import hf_base_from_gguf
    from tuneport.toolkit.smollm.package import fetch_model_file
    from tuneport.toolkit.smollm.styles import STYLES
    from tuneport.toolkit.smollm.train import adapters_root, train_lora

    base = hf_base_from_gguf(fetch_model_file())
    adapters = {n: train_lora(base, s.pairs(), adapters_root(base), n) for n, s in STYLES.items()}
    details = tuneport.export(base=base, adapters=[f"{n}={p}" for n, p in adapters.items()], target="gguf",
                              adapter_mode="separate", quant="q8_0", name="smollm2", out=work / "gguf").details
    return work / "gguf" / details["models"]["q8_0"], {n: str(work / "gguf" / p) for n, p in details["loras"].items()}


def row(label: str, res: dict, ref: dict | None) -> list[str]:
    lat = res["lat"]
    tps = res["tokens"] / res["wall"]
    ratio = f"{tps / (ref['tokens'] / ref['wall']):.2f}x" if ref else "1.00x"
    return [label, f"{res['tokens']}", f"{tps:.1f}", ratio, f"{lat[len(lat) // 2]:.2f}",
            f"{lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.2f}", f"{res['peak_rss_mb']:.0f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/serve-real"))
    ap.add_argument("--rounds", type=int, default=2, help="each question to each model this many times")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--contexts", type=int, default=1, help="tuneport serve --contexts (llama.cpp contexts)")
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    model, loras = prepare(work)
    rows = []
    for label, names in (("base only", [None]), ("3 models, round robin (base, pirate, json)", [None, *loras])):
        jobs = [(n, q) for q in QUESTIONS * args.rounds for n in names]
        fields = {"jobs": jobs, "model": str(model), "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                  "contexts": args.contexts}
        ref = run_python(BASELINE.format(loras={n: loras[n] for n in names if n}, **fields))
        got = run_python(TUNEPORT.format(loras={n: loras[n] for n in names if n}, **fields))
        rows.append(row(f"llama-cpp-python Llama per model: {label}", ref, None))
        rows.append(row(f"tuneport serve (HTTP): {label}", got, ref))
    print(f"machine: {machine()}")
    print(f"model: SmolLM2-135M-Instruct Q8_0 ({model.stat().st_size / 2**20:.0f} MiB) + 2 LoRAs r=8 (F32 GGUF); "
          f"{len(QUESTIONS)} real chat prompts x {args.rounds} rounds per model, greedy, up to {args.max_tokens} "
          f"tokens (stopping at EOS); concurrency {args.concurrency}\n")
    print(table(rows, ["server: traffic", "tokens", "tokens/s", "vs baseline", "p50 s", "p99 s", "peak RSS MB"]))


if __name__ == "__main__":
    main()
