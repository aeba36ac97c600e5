"""Run in a child process by :mod:`.vllm_runner`: vLLM (in-process engine; fp32, or a 4-bit model's own 16-bit
dtype) on one model per job, with and without a LoRA; prints the top-k log-probabilities at every position and
greedy tokens as JSON. Jobs arrive one JSON line at a time on stdin, so one process (vLLM imported once) serves
every verification of its parent; a job that fails ends the process after its error line.

Usage: python -m tuneport.toolkit.verify.vllm_child  (jobs on stdin, results on stdout)
"""

from __future__ import annotations

import gc
import json
import os
import sys

MARKER = "@@TUNEPORT-VLLM@@"
FAILED = "@@TUNEPORT-VLLM-FAILED@@"


def _dist(entry) -> dict[int, float]:
    return {int(t): float(lp.logprob) for t, lp in (entry or {}).items()}


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    k, ids = job["top_k"], job["ids"]
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enable_lora=bool(job["lora"]),
              max_lora_rank=job.get("max_lora_rank") or 16, max_loras=1, max_model_len=job["max_model_len"],
              enforce_eager=True, seed=0, max_logprobs=k)
    runs = {"lora": LoRARequest("verify", 1, job["lora"])} if job["lora"] else {}
    runs["plain"] = None
    out = {}
    for name, lora in runs.items():
        scored = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, logprobs=k),
                              lora_request=lora, use_tqdm=False)[0]
        # row t: the distribution of the token after ids[:t + 1] (prompt_logprobs[t + 1]; the last from the
        # first generated token's logprobs)
        rows = [_dist(e) for e in scored.prompt_logprobs[1:]] + [_dist(scored.outputs[0].logprobs[0])]
        greedy = llm.generate([TokensPrompt(prompt_token_ids=job["greedy_prompt"])],
                              SamplingParams(temperature=0.0, max_tokens=job["greedy_tokens"], ignore_eos=True),
                              lora_request=lora, use_tqdm=False)[0]
        out[name] = {"rows": [list(r.items()) for r in rows], "greedy": list(greedy.outputs[0].token_ids)}
    del llm
    gc.collect()
    return out


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = run_job(json.loads(line))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, then this process ends
            print(FAILED + json.dumps(f"{type(e).__name__}: {e}"[:500]), flush=True)
            raise
        print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
