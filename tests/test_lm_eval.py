"""lm-eval (EleutherAI's evaluation harness) against `tuneport serve --engine llamacpp`, for the base and an
adapter, each equal to the same harness on transformers + PEFT (its `hf` model with `peft=`, float32); the
server runs an F32 GGUF and GGUF LoRA with an F32 KV cache, converted on start from the HF base and PEFT dir.

- `local-completions` scores a loglikelihood task (prompt logprobs: echo + logprobs on /v1/completions,
  prompts sent as token ids, four to a request) and the continuations each model generates greedily
  (is_greedy); it runs a generation task (token-id prompts, stop strings);
- `local-chat-completions` runs the generation task through the chat template (the server renders it).

The tasks are tests/lm_eval_tasks (local jsonl data: the harness's stock tasks download from the hub).
lm-eval comes from the `eval` extra, which `make setup` installs into the one test environment.

The tiny qwen2 (byte-level BPE) is the model: its tokenizer decodes and renders chat as llama.cpp's does.
The tiny llama's SentencePiece does not, for reasons outside the server: llama.cpp puts a space before text
that follows a special token ("[INST] The" -> [INST] "▁▁" "T", HF with legacy=False: [INST] "▁T"), and HF's
byte-fallback decoder writes one U+FFFD per byte of a run of byte tokens that is not UTF-8 ("\\xe2" "7" "7"
-> "���", llama.cpp and Python: "�77")."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from tests_helpers import free_port

from tuneport.serve.http import wait_for_health

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="tuneport-test-datasets-"))

pytest.importorskip("lm_eval", reason="lm-eval is the `eval` extra: pip install -e '.[eval]'")
pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "lm_eval_tasks"  # their data_files are relative to the repository root
ARCH, ADAPTER = "qwen2", "plain"
# |served - PEFT| of a continuation's summed logprob (1-8 tokens after up to 16 tokens). llama.cpp's F32
# kernels sum in another order than torch's: at most 7.7e-6 measured (base 5.0e-6, adapter 7.7e-6). 1e-4
# leaves room for other CPUs' kernels and still catches a logprob taken one position off or with the wrong
# adapter (errors of 0.1 and more).
LL_TOL = 1e-4


def evaluate(model: str, model_args: dict, task: str, **kw) -> tuple[dict, list[dict]]:
    """``lm_eval.simple_evaluate`` on one of our tasks: (its results, its samples by doc_id)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = os.getcwd()
    os.chdir(REPO)
    try:  # include_defaults=False: indexing lm-eval's thousands of stock task files takes seconds a run
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                      bootstrap_iters=0, **kw)
    finally:
        os.chdir(cwd)
    return out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def harness_model(model: str, model_args: dict):
    """One of lm-eval's model classes, to send it requests without a task."""
    from lm_eval.api.registry import get_model

    return get_model(model).create_from_arg_obj(model_args)


def requests(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def hf_base(zoo, tmp_path_factory) -> Path:
    """The tiny base for the `hf` model, without its generation_config's max_new_tokens: transformers
    lets that win over the max_length lm-eval passes (the task's max_gen_toks)."""
    out = tmp_path_factory.mktemp("lm-eval") / ARCH
    shutil.copytree(zoo.base(ARCH), out)
    cfg = json.loads((out / "generation_config.json").read_text())
    cfg.pop("max_new_tokens", None)
    (out / "generation_config.json").write_text(json.dumps(cfg))
    return out


def hf_args(zoo, hf_base: Path, adapter: str | None) -> dict:
    args = {"pretrained": str(hf_base), "dtype": "float32", "device": "cpu", "add_bos_token": True,
            "batch_size": 4}
    return {**args, "peft": str(zoo.adapter(ARCH, adapter))} if adapter else args


@pytest.fixture(scope="module")
def server(zoo):
    """`tuneport serve --engine llamacpp` from the HF base and the PEFT adapter dir; yields (url, base name)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--engine", "llamacpp",
                             "--base", str(zoo.base(ARCH)), "--dtype", "fp32", "--kv-f32",
                             "--adapter", f"{ADAPTER}={zoo.adapter(ARCH, ADAPTER)}", "--port", str(port),
                             "--n-ctx", "256", "--contexts", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if not wait_for_health(url, 180, alive=lambda: proc.poll() is None, interval_s=0.2):
            proc.kill()
            pytest.fail(f"tuneport serve did not start: {proc.communicate(timeout=30)[1][-3000:]}")
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ADAPTER in models
        yield url, next(m for m in models if m != ADAPTER)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=60)


def served_args(url: str, endpoint: str, model: str, **kw) -> dict:
    # max_retries 1: a refused request fails the test at once instead of being retried with back-off
    return {"base_url": f"{url}/v1/{endpoint}", "model": model, "max_retries": 1, "timeout": 120, **kw}


def completions_args(url: str, model: str, tokenizer: Path) -> dict:
    """local-completions as for a local server: token-id prompts (the HF tokenizer, BOS as `hf` with
    add_bos_token), four prompts to a request."""
    return served_args(url, "completions", model, tokenizer=str(tokenizer), tokenizer_backend="huggingface",
                       tokenized_requests=True, add_bos_token=True, batch_size=4)


def assert_scores_equal(ref: list[tuple[float, bool]], got: list[tuple[float, bool]], what) -> float:
    """Each (loglikelihood, is_greedy) pair as the reference's; returns the largest difference."""
    worst = 0.0
    for i, ((ref_ll, ref_greedy), (ll, greedy)) in enumerate(zip(ref, got, strict=True)):
        assert math.isfinite(ll) and abs(ll - ref_ll) <= LL_TOL, (what, i, ll, ref_ll)
        assert greedy == ref_greedy, (what, i, ll, ref_ll, greedy)
        worst = max(worst, abs(ll - ref_ll))
    return worst


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_loglikelihood_scores_equal_transformers_peft(zoo, hf_base, server, adapter):
    url, base_name = server
    served = completions_args(url, adapter or base_name, hf_base)
    ref_results, ref = evaluate("hf", hf_args(zoo, hf_base, adapter), "tiny_mc")
    results, got = evaluate("local-completions", served, "tiny_mc")
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in ref] == list(range(10))
    assert [s["arguments"] for s in got] == [s["arguments"] for s in ref]  # the same (context, continuation)
    worst = max(assert_scores_equal(r["filtered_resps"], g["filtered_resps"], ("tiny_mc", r["doc_id"]))
                for r, g in zip(ref, got, strict=True))
    assert results["acc,none"] == ref_results["acc,none"]
    assert results["acc_norm,none"] == ref_results["acc_norm,none"]

    # The task's choices are never the tiny model's greedy tokens: score what the reference generates
    # greedily, so that is_greedy is True somewhere (where the text tokenizes back to the same tokens).
    hf = harness_model("hf", hf_args(zoo, hf_base, adapter))
    prompts = [json.loads(line)["prompt"] for line in (TASKS / "tiny_gen.jsonl").read_text().splitlines()]
    texts = hf.generate_until(requests("generate_until", [(p, {"until": ["\n"], "max_gen_toks": 6,
                                                                "do_sample": False}) for p in prompts]))
    pairs = requests("loglikelihood", [(p, t) for p, t in zip(prompts, texts, strict=True) if t])
    ref_greedy = hf.loglikelihood(pairs)
    assert any(g for _, g in ref_greedy), (texts, ref_greedy)
    got_greedy = harness_model("local-completions", served).loglikelihood(pairs)
    worst = max(worst, assert_scores_equal(ref_greedy, got_greedy, "greedy continuations"))
    print(f"lm-eval loglikelihoods ({adapter or 'base'}): largest |served - PEFT| {worst:.2e}")


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_generation_equals_transformers_peft_greedy(zoo, hf_base, server, adapter):
    """local-completions (token-id prompts, four to a request) and local-chat-completions (messages, the
    chat template rendered by the server) write what `hf` writes, greedily (without and with its
    apply_chat_template)."""
    url, base_name = server
    model = adapter or base_name
    _, ref = evaluate("hf", hf_args(zoo, hf_base, adapter), "tiny_gen")
    _, got = evaluate("local-completions", completions_args(url, model, hf_base), "tiny_gen")
    _, ref_chat = evaluate("hf", hf_args(zoo, hf_base, adapter), "tiny_gen", apply_chat_template=True)
    _, chat = evaluate("local-chat-completions", served_args(url, "chat/completions", model), "tiny_gen",
                       apply_chat_template=True)
    for want, have in ((ref, got), (ref_chat, chat)):
        assert [s["doc_id"] for s in have] == [s["doc_id"] for s in want] == list(range(5))
        assert [s["filtered_resps"][0] for s in have] == [s["filtered_resps"][0] for s in want]
