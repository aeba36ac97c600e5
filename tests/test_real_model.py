"""The real demo end to end on SmolLM2-135M-Instruct (from the package index; skipped when the index cannot
be reached): the served chat answers of the base and both trained adapters equal transformers + PEFT
greedy generation (F32 GGUF, F32 KV cache); the F32 GGUF and GGUF LoRAs equal transformers/PEFT within
1e-3; llama.cpp's tokenizer and chat template give the HF tokenizer's tokens; each adapter changes the answer.

Cold (an empty fixture cache): download, HF base, two trainings, exports, serving (~4 min on 2 cores); then the
model file, base and trained adapters come from the fixture cache, keyed by content hash.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tuneport
from tuneport.convert.tokenizer_parity import CHATS, TOKENIZER_BATTERY
from tuneport.toolkit.smollm.package import PackageUnavailable

pytestmark = pytest.mark.llamacpp
N_COMPARED = 16  # served tokens compared with transformers' greedy generation
TOL = 1e-3


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The demo's deterministic inputs (the model file, the HF base rebuilt from it, the two adapters, each keyed by
    the hash of what made it) come from the fixture cache after the first run; its exports, serving and every
    comparison run each time."""
    from tuneport.toolkit.demo import DemoOptions, RealDemo
    from tuneport.toolkit.smollm.package import fetch_model_file
    from tuneport.toolkit.tiny.trained import fixture_cache

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TUNEPORT_CACHE_DIR", str(fixture_cache() / "real-demo"))
        try:
            source = fetch_model_file()
        except PackageUnavailable as e:
            pytest.skip(f"the package index cannot be reached: {e.message}")
        opts = DemoOptions(out=tmp_path_factory.mktemp("real-demo"), quants=("f32", "q8_0", "q4_k_m"),
                           serve_quant="f32", kv_f32=True)
        report = RealDemo(opts, source).run()
    print(f"\nreal demo steps (s): {report['timings_s']}")
    return report


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["base"])


def _hf_greedy(demo: dict, adapter: str | None, tokenizer) -> dict[str, list[int]]:
    from tuneport.toolkit.fidelity import load_hf, load_peft

    model = load_peft(demo["base"], demo["adapters"][adapter]) if adapter else load_hf(demo["base"])
    out = {}
    for question in demo["served"]["answers"]["base"]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=N_COMPARED, do_sample=False)[0, ids["input_ids"].shape[1]:]
        out[question] = [t for t in gen.tolist() if t != tokenizer.eos_token_id]
    return out


@pytest.mark.parametrize("model", ["base", "pirate", "json"])
def test_served_chat_answers_equal_transformers_and_peft(demo, tokenizer, model):
    assert demo["served"]["kv_f32"] and demo["served"]["model_file"].endswith("-F32.gguf")
    reference = _hf_greedy(demo, None if model == "base" else model, tokenizer)
    for question, ref in reference.items():
        served = demo["served"]["answers"][model][question]["token_ids"]
        assert served[:N_COMPARED] == ref, (model, question, tokenizer.decode(served), tokenizer.decode(ref))
        if len(ref) < N_COMPARED:  # transformers stopped at EOS: so did the server
            assert len(served) == len(ref)
        text = demo["served"]["answers"][model][question]["text"]
        assert text.startswith(tokenizer.decode(ref, skip_special_tokens=True).rstrip("\ufffd"))


def test_each_adapter_changes_the_answer(demo):
    answers = demo["served"]["answers"]
    for question in answers["base"]:
        texts = {m: answers[m][question]["text"] for m in ("base", "pirate", "json")}
        assert len(set(texts.values())) == 3, texts
        assert texts["pirate"].startswith("Arr"), texts
        assert texts["json"].startswith('{"answer"'), texts


def test_f32_gguf_and_loras_equal_transformers_and_peft(demo):
    rows = [r for r in demo["gguf_fidelity"] if r["quant"] == "f32"]
    assert {r["adapter"] for r in rows} == {None, "pirate", "json"}
    for r in rows:
        assert r["max_abs"] < TOL and r["top1"] == 1.0, r
    merged = demo["merge_fidelity"]
    assert merged["max_abs"] < TOL and merged["top1"] == 1.0
    quantized = {(r["quant"], r["adapter"]): r for r in demo["gguf_fidelity"]}
    assert quantized[("q8_0", None)]["kl"] < 0.05 and quantized[("q4_k_m", None)]["kl"] < 0.5


def test_f32_gguf_logits_on_varied_text(demo, tokenizer):
    """Beyond the chat prompts: a long mixed text (code, unicode, digits) through the F32 GGUF."""
    from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, logits

    ids = tokenizer("\n".join(TOKENIZER_BATTERY[:20])).input_ids[:200]
    ref = logits(load_hf(demo["base"]), torch.tensor([ids]))[0]
    llm = llamacpp_model(demo["gguf"]["models"]["f32"], n_ctx=256)
    try:
        got = llamacpp_logits(llm, ids)
    finally:
        llm.close()
    cmp = compare_logits(ref, got)
    assert cmp.max_abs < TOL and cmp.top1 == 1.0, cmp


@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
def test_llamacpp_tokenizer_equals_hf(demo, tokenizer, quant):
    import llama_cpp

    assert len(TOKENIZER_BATTERY) >= 20
    llm = llama_cpp.Llama(model_path=demo["gguf"]["models"][quant], vocab_only=True, verbose=False)
    try:
        for text in TOKENIZER_BATTERY:
            hf = tokenizer(text).input_ids
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf, text
            assert llm.detokenize(hf, special=True).decode() == tokenizer.decode(hf), text
    finally:
        llm.close()


def test_chat_template_renders_the_same_tokens(demo, tokenizer):
    for answers in demo["served"]["answers"].values():  # what the gateway rendered for each request
        for question, a in answers.items():
            assert a["prompt_token_ids"] == tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"]
    with tuneport.serve(base=Path(demo["gguf"]["models"]["q8_0"]), engine="llamacpp", n_ctx=256, port=0) as server:
        for messages in CHATS:
            assert server.backend.chat_tokens(messages) == tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"], messages


def _ollama_prompt(template: str, system: str, prompt: str) -> str:
    """Ollama's rendering of a one-turn chat up to the answer, for the Go templates tuneport writes
    (``{{ if .X }}…{{ end }}`` and ``{{ .X }}``)."""
    values = {"System": system, "Prompt": prompt}
    text = template.split("{{ .Response }}")[0]
    text = re.sub(r"\{\{ if \.(\w+) \}\}(.*?)\{\{ end \}\}", lambda m: m.group(2) if values[m.group(1)] else "",
                  text, flags=re.S)
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values[m.group(1)], text)


def test_modelfile_renders_what_the_chat_template_renders(demo, tokenizer):
    """SmolLM2's template adds a default system prompt: the Modelfile carries it as SYSTEM, so Ollama's
    prompt equals transformers' with and without a system message."""
    text = (Path(demo["gguf"]["dir"]) / "Modelfile.pirate").read_text()
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    system = re.search(r'SYSTEM """(.*?)"""', text, re.S).group(1)
    assert "SmolLM" in system
    question = "What do plants need to grow?"
    hf = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
    assert _ollama_prompt(template, system, question) == hf
    with_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": question}]
    hf = tokenizer.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False)
    assert _ollama_prompt(template, "Be terse.", question) == hf
