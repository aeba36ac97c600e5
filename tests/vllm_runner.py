"""Runs jobs in real vLLM (in-process engine, fp32, CPU) and prints greedy tokens as JSON.

Usage: python tests/vllm_runner.py JOBS.json  ->  stdout: one JSON line after the marker.
A job is {"bundle": dir} (reads tuneport's vllm_launch.json: base + adapters, all in one batch; with
"with_base": true the base answers the prompts too, under the name "", in a batch of its own) or
{"model": dir} (a merged model, no LoRA). Each job has "prompts" (token id lists), or "texts" and "images"
(an image file or null per text), and "max_tokens"; the result also holds each greedy token's logprob, and with
"prompt_logprobs": true each prompt token's (as vLLM expanded the prompt).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MARKER = "@@VLLM-RESULT@@"


def launch_options(bundle: Path) -> tuple[Path, dict, dict[str, str]]:
    cmd = json.loads((bundle / "vllm_launch.json").read_text())["command"]
    opts: dict = {}
    loras: dict[str, str] = {}
    i = 0
    while i < len(cmd):
        a = cmd[i]
        if a == "--lora-modules":
            i += 1
            while i < len(cmd) and not cmd[i].startswith("--"):
                m = json.loads(cmd[i])
                loras[m["name"]] = str(bundle / m["path"])
                i += 1
            continue
        if a.startswith("--"):
            key = a[2:].replace("-", "_")
            if i + 1 < len(cmd) and not cmd[i + 1].startswith("--"):
                opts[key] = cmd[i + 1]
                i += 2
                continue
            opts[key] = True
        i += 1
    model = bundle / opts.pop("model")
    return model, opts, loras


def job_prompts(job: dict) -> list:
    """Token-id prompts, or text prompts each with an image file (multimodal models)."""
    from vllm.inputs import TokensPrompt

    if "texts" not in job:
        return [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    from PIL import Image

    return [{"prompt": t, "multi_modal_data": {"image": Image.open(i).convert("RGB")}} if i else {"prompt": t}
            for t, i in zip(job["texts"], job["images"], strict=True)]


def token_logprobs(output) -> list[float]:
    """The log-probability vLLM gave each greedy token."""
    return [step[tok].logprob for tok, step in zip(output.token_ids, output.logprobs or [], strict=False)]


def prompt_logprobs(output) -> list[float | None]:
    """The log-probability vLLM gave each prompt token after the ones before it (None for the first, and for all
    without "prompt_logprobs" in the job)."""
    rows = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return [row[tok].logprob if row else None for tok, row in zip(output.prompt_token_ids, rows, strict=True)]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = []
    for job in jobs:
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=0,
                            prompt_logprobs=0 if job.get("prompt_logprobs") else None)
        prompts = job_prompts(job)
        if "bundle" in job:
            model, opts, loras = launch_options(Path(job["bundle"]))
            llm = LLM(model=str(model), dtype=job.get("dtype", "float32"), enable_lora=True,
                      max_lora_rank=int(opts["max_lora_rank"]), max_loras=int(opts["max_loras"]),
                      max_cpu_loras=int(opts["max_cpu_loras"]), max_model_len=256, enforce_eager=True, seed=0)
            names = list(loras)
            reqs = [LoRARequest(n, i + 1, loras[n]) for i, n in enumerate(names)]
            result = {}
            if job.get("with_base"):  # the base alone first: vLLM CPU gives base requests batched with
                # adapters the last slot's adapter (serve/vllm_bugs.py; `tuneport serve` guards it)
                outs = llm.generate(prompts, sp, use_tqdm=False)
                result[""] = [list(o.outputs[0].token_ids) for o in outs]
            batch = [p for _ in names for p in prompts]
            lora_reqs = [r for r in reqs for _ in prompts]
            outs = llm.generate(batch, sp, lora_request=lora_reqs, use_tqdm=False)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            logprobs = [token_logprobs(o.outputs[0]) for o in outs]
            n = len(prompts)
            results.append({**result, **{name: toks[i * n:(i + 1) * n] for i, name in enumerate(names)},
                            "logprobs": {name: logprobs[i * n:(i + 1) * n] for i, name in enumerate(names)}})
        else:
            llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=256, enforce_eager=True,
                      seed=0)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            results.append({"": [list(o.outputs[0].token_ids) for o in outs],
                            "logprobs": [token_logprobs(o.outputs[0]) for o in outs],
                            "prompt": [[list(o.prompt_token_ids), prompt_logprobs(o)] for o in outs]})
        del llm
        gc.collect()
    print(MARKER + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
