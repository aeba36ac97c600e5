"""The parts the in-process engines answer OpenAI fields with, without an engine: schema refusals and the
grammar fixes, tool-call syntaxes and parsing, the UTF-8 mask, choices built from events (stops, tool calls,
echo, log-probabilities)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tuneport.serve.engines.base import Step, token_logprobs
from tuneport.serve.engines.utf8 import Utf8Table
from tuneport.serve.errors import ApiError
from tuneport.serve.openai_choices import ChoiceBuilder, chat_logprobs, completion_logprobs
from tuneport.serve.structured import grammar_for, schema_grammar
from tuneport.serve.tool_calls import SYNTAXES, call_grammar, forced_names, parse_calls, syntax_of, template_messages
from tuneport.toolkit.tiny.tokenizers import CHATML_TEMPLATE, TOOLS_TEMPLATE

HERMES = SYNTAXES[0]


def test_schema_keywords_the_grammar_cannot_enforce_are_refused_by_name():
    with pytest.raises(ApiError, match=r"schema\.properties\.n\.minimum"):
        schema_grammar({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}})
    with pytest.raises(ApiError, match=r"uniqueItems"):
        schema_grammar({"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    with pytest.raises(ApiError, match=r"only local references"):
        schema_grammar({"$ref": "https://example.com/s.json"})
    with pytest.raises(ApiError, match=r"format=email"):
        schema_grammar({"type": "string", "format": "email"})
    ok = schema_grammar({"title": "t", "description": "d", "type": "object", "properties": {
        "a": {"enum": ["x"]}, "b": {"type": "string", "maxLength": 3}}, "required": ["a"]})
    assert "root ::=" in ok and r"\x00-\x1F" in ok  # strings exclude raw control characters


def test_response_format_shapes():
    assert grammar_for(None) is None and grammar_for({"type": "text"}) is None
    assert "object" in grammar_for({"type": "json_object"})
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(ApiError):
            grammar_for(bad)


def test_tool_syntax_comes_from_the_template_or_is_refused_with_the_reason():
    assert syntax_of(TOOLS_TEMPLATE).name == "hermes"
    with pytest.raises(ApiError, match="does not render tools"):
        syntax_of(CHATML_TEMPLATE)
    with pytest.raises(ApiError, match="syntax tuneport does not parse"):
        syntax_of("{% for t in tools %}{{ t }}{% endfor %}<function_call>")


def test_calls_parse_back_and_bad_ones_stay_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}'
    calls = parse_calls(text, HERMES)
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert json.loads(calls[0].as_openai()["function"]["arguments"]) == {"x": 1}
    assert parse_calls("<tool_call>{not json}</tool_call>", HERMES) is None


def test_forced_calls_and_their_grammar():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"enum": [1, 2]}}, "required": ["a"]}}}]
    assert forced_names("auto", tools) is None and forced_names("required", tools) == ["f"]
    assert forced_names({"type": "function", "function": {"name": "f"}}, tools) == ["f"]
    with pytest.raises(ApiError, match="not among the tools"):
        forced_names({"type": "function", "function": {"name": "nope"}}, tools)
    g = call_grammar(HERMES, tools, ["f"])
    assert g.startswith('root ::= "<tool_call>\\n" call "\\n</tool_call>"') and "\ncall ::=" in g
    nested = [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}}}}}]
    assert "tool0-Loc ::=" in call_grammar(HERMES, nested, ["g"])  # a tool's own $defs still resolve

def test_tool_call_arguments_go_back_to_templates_as_objects():
    msgs = [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                  "function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    call = template_messages(msgs)[0]["tool_calls"][0]
    assert call["function"]["arguments"] == {"a": 1} and call["name"] == "f"


def test_utf8_mask_keeps_multibyte_characters_whole():
    pieces = [b"a", "é".encode(), b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xa9x", b"\xff", b"", b""]
    t = Utf8Table(pieces, ends=np.array([False] * 8 + [True, False]))  # 8: end of generation, 9: a control token
    assert list(t.allowed(0)) == [True, True, True, False, True, False, False, False, True, False]
    assert t.after(0, 2) == 1 and list(np.flatnonzero(t.allowed(1))) == [3, 5, 6, 8]
    assert t.after(1, 3) == 0 and t.after(0, 4) == 1 and t.after(1, 5) == 0


def test_token_logprobs_are_the_log_softmax_and_its_top_k():
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    lp, top = token_logprobs(logits, 2, 2)
    ref = logits - np.log(np.exp(logits).sum())
    assert abs(lp - ref[2]) < 1e-6 and [t for t, _ in top] == [1, 2] and abs(top[0][1] - ref[1]) < 1e-6


PIECES = {i: bytes([i]) for i in range(256)}


def piece(t: int) -> bytes:
    return PIECES[t]


def steps(text: str, logprob: float | None = None):
    return [Step(0, b, logprob, ((b, logprob),) if logprob is not None else None) for b in text.encode()]


def run(builder: ChoiceBuilder, text: str, logprob: float | None = None):
    out = [d for s in steps(text, logprob) if (d := builder.step(s)) is not None]
    return out + [builder.end()]


def test_choice_text_cuts_at_a_stop_string_and_holds_a_forming_one():
    b = ChoiceBuilder(0, piece, ["END"], max_tokens=100)
    deltas = run(b, "abc ENxyzEND more")
    assert "".join(d.text for d in deltas) == "abc ENxyz" and deltas[-1].finish == "stop"
    b = ChoiceBuilder(0, piece, [], max_tokens=3)
    assert [d.finish for d in run(b, "abc")][-1] == "length"
    b = ChoiceBuilder(0, piece, ["b", "a"], max_tokens=10)  # the earliest stop in the text wins, not the first listed
    assert "".join(d.text for d in run(b, "xab")) == "x"


def test_choice_echo_and_offsets():
    b = ChoiceBuilder(0, piece, [], max_tokens=2, text="Hi ")
    deltas = run(b, "yo", logprob=-0.5)
    assert "".join(d.text for d in deltas) == "Hi yo"
    scored = [s for d in deltas for s in d.scored]
    assert [s.offset for s in scored] == [3, 4]
    legacy = completion_logprobs(scored, piece, 1)
    assert legacy["tokens"] == ["y", "o"] and legacy["text_offset"] == [3, 4]
    assert legacy["top_logprobs"][0] == {"y": -0.5}
    chat = chat_logprobs(scored, piece)["content"][0]
    assert chat["token"] == "y" and chat["bytes"] == [ord("y")] and chat["top_logprobs"][0]["logprob"] == -0.5


def test_choice_holds_a_tool_call_back_from_the_content():
    b = ChoiceBuilder(0, piece, [], max_tokens=200, tools=HERMES)
    deltas = run(b, 'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    content = "".join(d.text for d in deltas)
    assert content == "Let me check. " and deltas[-1].finish == "tool_calls"
    assert deltas[-1].tool_calls[0].name == "f"
    b = ChoiceBuilder(0, piece, [], max_tokens=200, tools=HERMES)
    deltas = run(b, "<tool_call> not a call")
    assert "".join(d.text for d in deltas) == "<tool_call> not a call" and deltas[-1].finish == "stop"


def test_request_values_are_typed_and_a_bad_one_names_its_field():
    from tuneport.serve.openai_request import parse_request

    r = parse_request("completions", {"prompt": [[1, 2], [3]], "logprobs": 1, "echo": True, "temperature": None})
    assert r.top_k() == 1 and r.echo and r.temperature == 1.0
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}).top_k() == 0
    for kind, body, field in (("completions", {"prompt": [1, -1]}, "prompt"),
                              ("completions", {"temperature": True}, "temperature"),
                              ("completions", {"top_p": 0}, "top_p"),
                              ("completions", {"logprobs": 21}, "logprobs"),
                              ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                               "top_logprobs"),
                              ("chat", {"messages": []}, "messages")):
        with pytest.raises(ApiError, match=f"'{field}'"):
            parse_request(kind, body).top_k()


def test_a_tiny_temperature_samples_the_argmax_rather_than_failing():
    from tuneport.serve.engines.base import GenerationRequest, sample

    logits = np.array([0.5, 2.0, -np.inf, 1.0], dtype=np.float32)
    req = GenerationRequest([1], temperature=1e-310)
    assert sample(logits, req, np.random.default_rng(0)) == 1
