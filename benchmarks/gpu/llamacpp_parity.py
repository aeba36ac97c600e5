"""tuneport's llama.cpp engine with its layers on the GPU against the same engine on the CPU (issue 30, check a).

On one machine whose llama-cpp-python loads a GPU build of llama.cpp (``LLAMA_CPP_LIB_PATH``, see
``benchmarks/gpu/device.sh``): a tiny llama (hidden 256, 2 layers) and 4 LoRAs, exported as F32 and F16 GGUF
with GGUF LoRAs, then
1. logits of 4 prompts, every layer on the GPU (``--gpu-layers all``) against every layer on the CPU (0), for
   the base and each adapter, F32 and F16: max |Δlogit| and KL; F32 also against transformers + PEFT (fp32);
2. ``tuneport serve`` of the F32 GGUF with the 4 adapters, mixed traffic (base + 4 adapters, 4 prompts each, 8
   at a time), greedy 16 tokens: each answer on the GPU equal to the same request on the CPU.
Writes ``OUT/llamacpp_parity.json`` and prints it. ``--cpu-check`` runs the "GPU" side with 0 layers too (the
script's own check on a machine without a GPU: every number must be exact).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ADAPTERS = ("plain", "all_linear", "rslora", "patterns")
PROMPTS = ([1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5], [1, 100, 101, 102, 103, 104, 105])
GREEDY = 16


def logits_rows(model: Path, lora: Path | None, n_gpu: int) -> list:
    from tuneport.toolkit.fidelity import llamacpp_logits, llamacpp_model

    llm = llamacpp_model(model, lora, n_ctx=64, n_gpu_layers=n_gpu)
    try:
        return [llamacpp_logits(llm, p) for p in PROMPTS]
    finally:
        llm.close()


def compare(a: list, b: list) -> dict:
    import torch

    from tuneport.toolkit.fidelity import compare_logits

    return compare_logits(torch.cat(a), torch.cat(b)).as_dict()


def served_answers(model: Path, loras: dict[str, Path], gpu_layers: str) -> dict[str, list[int]]:
    import httpx

    import tuneport

    with tuneport.serve(base=model, adapters=loras, gpu_layers=gpu_layers, kv_f32=True, n_ctx=128, max_adapters=8,
                        port=0) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        names = [server.backend.name, *loras]
        jobs = [(n, i) for i in range(len(PROMPTS)) for n in names]  # interleaved: every batch mixes adapters

        def ask(job: tuple[str, int]) -> tuple[str, list[int]]:
            name, i = job
            r = client.post("/v1/completions", json={"model": name, "prompt": PROMPTS[i], "max_tokens": GREEDY,
                                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return f"{'base' if name == names[0] else name}/{i}", r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(8) as ex:
            return dict(ex.map(ask, jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".bench/gpu")))
    ap.add_argument("--workdir", type=Path, default=Path(".bench/gpu-parity"))
    ap.add_argument("--cpu-check", action="store_true", help="the GPU side with 0 layers too")
    args = ap.parse_args()

    import tuneport
    from tuneport.convert.gguf.gpu import llamacpp_compute
    from tuneport.toolkit.fidelity import load_hf, load_peft, logits
    from tuneport.toolkit.tiny import TinyZoo

    compute = llamacpp_compute()
    if not args.cpu_check and not compute.gpu_offload:
        sys.exit(f"the loaded llama.cpp has no GPU backend ({', '.join(compute.backends)}): set LLAMA_CPP_LIB_PATH "
                 "to a GPU build (benchmarks/gpu/device.sh build), or pass --cpu-check")
    gpu = 0 if args.cpu_check else -1
    zoo = TinyZoo(args.workdir / "zoo")
    base = zoo.base("llama", wide=True)
    peft = {v: zoo.adapter("llama", v, wide=True) for v in ADAPTERS}
    t0 = time.perf_counter()
    result: dict = {"llamacpp": compute.to_dict(), "gpu_layers": "0 (cpu check)" if args.cpu_check else "all",
                    "logits": {}, "vs_peft": {}}
    ggufs = {}
    for quant in ("f32", "f16"):
        out = args.workdir / f"gguf-{quant}"
        if not out.exists():
            tuneport.export(base=base, adapters=[f"{n}={p}" for n, p in peft.items()], target="gguf",
                            adapter_mode="separate", quant=quant, out=out)
        model = next(out.glob("*.gguf"))
        loras = {n: out / "adapters" / f"{n}-F32.gguf" for n in ADAPTERS}
        ggufs[quant] = (model, loras)
        for name, lora in [("base", None), *loras.items()]:
            on_gpu, on_cpu = logits_rows(model, lora, gpu), logits_rows(model, lora, 0)
            result["logits"][f"{quant}/{name}"] = compare(on_cpu, on_gpu)
            if quant == "f32":
                import torch

                ref_model = load_peft(base, peft[name]) if lora else load_hf(base)
                ref = [logits(ref_model, torch.tensor([p]))[0] for p in PROMPTS]
                result["vs_peft"][name] = {"gpu": compare(ref, on_gpu), "cpu": compare(ref, on_cpu)}
    model, loras = ggufs["f32"]
    cpu = served_answers(model, loras, "0")
    on_gpu = served_answers(model, loras, "0" if args.cpu_check else "all")
    same = [k for k in cpu if cpu[k] == on_gpu[k]]
    result["served"] = {"requests": len(cpu), "equal_to_cpu": len(same),
                        "differ": {k: {"cpu": cpu[k], "gpu": on_gpu[k]} for k in cpu if k not in same}}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llamacpp_parity.json").write_text(json.dumps(result, indent=1, default=str))
    worst = max(v["max_abs"] for v in result["logits"].values())
    print(json.dumps({k: v for k, v in result.items() if k != "logits"}, indent=1, default=str))
    print(f"worst max|Δlogit| GPU vs CPU over {len(result['logits'])} runs: {worst:.3g}; served answers equal: "
          f"{len(same)}/{len(cpu)}")


if __name__ == "__main__":
    main()
