"""Reproduces the vLLM CPU bug "a base request batched with adapter requests, every LoRA slot full, gets
the last slot's adapter" against raw vLLM (in-process engine, fp32), and runs the same batch with
tuneport's mitigation (base as an all-zero adapter, one extra slot).

Usage: python tests/vllm_bug_runner.py JOB.json -> stdout: one JSON line after the marker.
JOB: {"base": dir, "adapters": {name: dir}, "guard": dir, "prompts": [[ids]...], "max_tokens": n}
Result: {"raw": {"base_alone": [...], "mixed": {label: tokens}}, "guarded": {"mixed": {...}}}
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


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    job = json.loads(Path(sys.argv[1]).read_text())
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    names = list(job["adapters"])
    reqs = [LoRARequest(n, i + 1, job["adapters"][n]) for i, n in enumerate(names)]

    def run(llm, batch):  # batch: [(prompt index, LoRARequest | None)]
        outs = llm.generate([prompts[i] for i, _ in batch], sp, lora_request=[r for _, r in batch], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # One request per adapter (filling every slot) and the base on the last prompt, in one batch.
    n = len(names)
    mixed = [(i, r) for i, r in enumerate(reqs)] + [(n, None)]
    labels = names + ["base"]
    result = {}
    llm = LLM(model=job["base"], dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=n,
              max_cpu_loras=n + 1, max_model_len=256, enforce_eager=True, seed=0)
    base_alone = run(llm, [(n, None)])[0]  # before any slot is used
    result["raw"] = {"base_alone": base_alone, "mixed": dict(zip(labels, run(llm, mixed), strict=True)),
                     "last_adapter_on_base_prompt": run(llm, [(n, reqs[-1])])[0]}
    del llm
    gc.collect()

    guard = LoRARequest("tuneport-base", n + 1, job["guard"])
    guarded = [(i, r) for i, r in enumerate(reqs)] + [(n, guard)]
    llm = LLM(model=job["base"], dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=n + 1,
              max_cpu_loras=n + 1, max_model_len=256, enforce_eager=True, seed=0)
    result["guarded"] = {"mixed": dict(zip(labels, run(llm, guarded), strict=True))}
    del llm
    gc.collect()
    print(MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
