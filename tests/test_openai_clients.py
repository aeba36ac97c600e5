"""The OpenAI API as the ``openai`` client uses it, on llama.cpp and vLLM, for the base and an adapter:
log-probabilities equal to the engine's own log-softmax (llama.cpp F32 GGUF + F32 KV: 1e-4; vLLM fp32 against
transformers + PEFT: 1e-3), echo with prompt scores, n choices sharing a seed, JSON-schema output that validates,
a tool call round trip through a chat template that renders tools, streaming of all of these, refusals by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

import tuneport

ENGINES = [pytest.param("llamacpp", marks=pytest.mark.llamacpp), pytest.param("vllm", marks=pytest.mark.vllm)]
TOLERANCE = {"llamacpp": 1e-4, "vllm": 1e-3}
ADAPTER = "plain"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"enum": [1, 2, 3]},
    "reason": {"type": "string", "pattern": "^[a-z ]{1,16}$"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                             "maxItems": 2}},
    "required": ["answer", "confidence", "reason", "tags"], "additionalProperties": False}


@dataclass
class Served:
    engine: str
    client: openai.OpenAI
    base: str  # the served base model's name
    reference: dict  # model name -> (ids -> log-softmax rows, float64)


def _llamacpp_reference(gguf: Path, lora: Path | None):
    from tuneport.toolkit.fidelity import llamacpp_logits, llamacpp_model

    def rows(ids: list[int]) -> np.ndarray:
        llm = llamacpp_model(gguf, lora, n_ctx=256)
        try:
            return _log_softmax(llamacpp_logits(llm, ids).numpy())
        finally:
            llm.close()

    return rows


def _transformers_reference(base: Path, adapter: Path | None):
    import torch

    from tuneport.toolkit.fidelity import load_peft

    def rows(ids: list[int]) -> np.ndarray:
        if adapter is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        else:
            model = load_peft(base, adapter)
        with torch.no_grad():
            return _log_softmax(model(torch.tensor([ids])).logits[0].numpy())

    return rows


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=ENGINES)
def served(request, zoo, tmp_path_factory):
    engine = request.param
    base, adapter = zoo.tool_base("qwen2"), zoo.adapter("qwen2", ADAPTER)
    if engine == "llamacpp":
        out = tmp_path_factory.mktemp("clients") / "gguf"
        tuneport.export(base=base, adapters=[f"{ADAPTER}={adapter}"], target="gguf", adapter_mode="separate",
                        quant="f32", out=out)
        gguf, lora = next(out.glob("*-F32.gguf")), out / "adapters" / f"{ADAPTER}-F32.gguf"
        server = tuneport.serve(base=gguf, adapters={ADAPTER: lora}, engine="llamacpp", port=0, n_ctx=1024,
                                contexts=1, kv_f32=True)
        reference = {server.backend.name: _llamacpp_reference(gguf, None), ADAPTER: _llamacpp_reference(gguf, lora)}
    else:
        server = tuneport.serve(base=base, adapters={ADAPTER: adapter}, engine="vllm", port=0, dtype="fp32",
                                max_model_len=1024, log_file=tmp_path_factory.mktemp("vllm") / "engine.log",
                                vllm_args=["--enforce-eager", "--max-num-seqs", "8"])
        reference = {server.backend.name: _transformers_reference(base, None),
                     ADAPTER: _transformers_reference(base, adapter)}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    yield Served(engine, client, server.backend.name, reference)
    server.close()


def models(served: Served) -> list[str]:
    return [served.base, ADAPTER]


def test_completion_logprobs_and_echo_equal_the_engine_log_softmax(served):
    """echo + logprobs scores every prompt token and the answer's (lm-eval's loglikelihood request), with a batch
    of token-id prompts; each value equals the engine's own log-softmax, and the alternatives are its top k."""
    prompts = [[1, 50, 60, 70, 80], [1, 200, 300, 411]]
    for model in models(served):
        r = served.client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0, echo=True,
                                             logprobs=3, extra_body={"return_token_ids": True})
        assert [c.index for c in r.choices] == [0, 1]
        for prompt, choice in zip(prompts, r.choices, strict=True):
            ids = prompt + choice.model_extra["token_ids"]
            ref = served.reference[model](ids)
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
            got = np.array(lp.token_logprobs[1:])
            want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
            np.testing.assert_allclose(got, want, atol=TOLERANCE[served.engine], rtol=0)
            for i in range(1, len(ids)):  # the alternatives: the k most likely, with their values (keyed by text:
                want_top = np.sort(ref[i - 1])[::-1][:3]  # two tokens spelled alike share one key; vLLM adds
                assert 1 <= len(lp.top_logprobs[i]) <= 4  # the chosen token to its top 3)
                for tok, v in lp.top_logprobs[i].items():
                    if tok != lp.tokens[i]:
                        assert np.abs(want_top - v).min() <= TOLERANCE[served.engine], (v, want_top)
            assert choice.model_extra["token_ids"] == [int(ref[len(prompt) - 1 + j].argmax()) for j in range(3)]


def test_chat_logprobs_stream_and_whole_agree_with_the_engine(served):
    messages = [{"role": "user", "content": "Say something about adapters."}]
    for model in models(served):
        whole = served.client.chat.completions.create(
            model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = whole.choices[0]
        ids = whole.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
        ref = served.reference[model](ids)
        start = len(whole.model_extra["prompt_token_ids"])
        got = [e.logprob for e in choice.logprobs.content]
        want = [ref[start - 1 + j, t] for j, t in enumerate(choice.model_extra["token_ids"])]
        np.testing.assert_allclose(got, want, atol=TOLERANCE[served.engine], rtol=0)
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
                   for e in choice.logprobs.content)
        chunks = list(served.client.chat.completions.create(
            model=model, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert text == choice.message.content
        np.testing.assert_allclose(streamed, got, atol=1e-6)
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []


def test_n_choices_with_a_seed_differ_and_reproduce(served):
    for model in models(served):
        def ask(model=model, **kw):
            return served.client.completions.create(model=model, prompt="The adapters", max_tokens=8, n=3, seed=7,
                                                    temperature=1.0, extra_body={"ignore_eos": True}, **kw)
        first, again = ask(), ask()
        texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
        assert len(set(texts)) == 3, texts
        assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
        assert first.usage.completion_tokens == 24
        chunks = list(ask(stream=True))
        streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                    for i in range(3)}
        assert [streamed[i] for i in range(3)] == texts


def test_json_schema_output_validates_for_20_prompts(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER_SCHEMA}}
    subjects = ["adapters", "quantization", "llamas", "GGUF", "vLLM", "merging", "tokens", "templates", "caches",
                "schedulers"]
    for k in range(20):
        model = models(served)[k % 2]
        r = served.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Is {subjects[k % 10]} useful? Answer in JSON."}],
            response_format=fmt, max_tokens=120, temperature=0.8, seed=k)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)


def test_free_strings_are_bounded_utf8_without_control_characters(served):
    """A maxLength string over a byte-level vocabulary: the grammar counts characters, so the output must stay
    valid UTF-8 (no stray byte counted as a character) and JSON (no raw control characters). vLLM 0.32's
    xgrammar lets both through on this fixture (docs/api-compat.md), so this is llama.cpp's guarantee."""
    if served.engine == "vllm":
        pytest.skip("vLLM's xgrammar: raw control characters and broken UTF-8 in maxLength strings (measured)")
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 16},
                                               "any": {"type": "string", "pattern": "^.{1,8}$"}},
              "required": ["note", "any"], "additionalProperties": False}  # "." may not be a quote or control
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": schema}}
    for k in range(10):
        r = served.client.chat.completions.create(
            model=models(served)[k % 2], messages=[{"role": "user", "content": f"Note {k}"}], response_format=fmt,
            max_tokens=160, temperature=1.5, seed=k)
        assert r.choices[0].finish_reason == "stop" and "\ufffd" not in r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_output_parses(served):
    for model in models(served):
        r = served.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Give me a JSON object."}],
            response_format={"type": "json_object"}, max_tokens=150, temperature=0)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_call_round_trip(served):
    """A call forced by tool_choice comes back as tool_calls (valid arguments); its result goes back as a tool
    message through the template, and the model answers; streamed calls arrive as tool_calls deltas."""
    for model in models(served):
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = served.client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                                      tool_choice=choice, max_tokens=200, temperature=0)
            c = r.choices[0]
            # OpenAI (and vLLM) end a call forced by name with "stop"
            named = isinstance(choice, dict) and served.engine == "vllm"
            assert c.finish_reason == ("stop" if named else "tool_calls") and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0]
            assert call.function.name == "get_weather" and call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
        r2 = served.client.chat.completions.create(model=model, messages=follow, tools=[WEATHER], max_tokens=6,
                                                   temperature=0, extra_body={"ignore_eos": True})
        assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result were rendered
        assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
        chunks = list(served.client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=200, temperature=0,
            stream=True))
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        args = "".join(tc.function.arguments or "" for tc in calls)
        assert [tc.function.name for tc in calls if tc.function.name] == ["get_weather"]
        assert json.loads(args) == json.loads(call.function.arguments)
        assert chunks[-1].choices[0].finish_reason in ("tool_calls", "stop")


def test_refused_fields_name_themselves(served):
    asks = [{"suffix": "x"}] + ([{"logit_bias": {"5": 1}}, {"frequency_penalty": 0.5}]
                                if served.engine == "llamacpp" else [])
    for kw in asks:
        with pytest.raises(openai.BadRequestError) as e:
            served.client.completions.create(model=served.base, prompt="The", max_tokens=2, **kw)
        assert f"'{next(iter(kw))}'" in str(e.value), e.value
    if served.engine == "llamacpp":
        with pytest.raises(openai.BadRequestError, match="minimum"):
            served.client.chat.completions.create(
                model=served.base, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}})
