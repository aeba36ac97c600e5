"""OpenAI ``tools`` for engines that render chat templates themselves (llama.cpp): which tool-call syntax a
model's chat template teaches, how a call is found in the output and parsed back into ``tool_calls``, and the
grammar that forces a call when ``tool_choice`` demands one.

The syntaxes are a table: a template that renders ``tools`` but teaches none of them is refused with the
reason, as is a template that does not render ``tools`` at all. The same names are vLLM's
``--tool-call-parser`` names.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import ApiError


@dataclass(frozen=True)
class ToolSyntax:
    """How a family of chat templates asks for tool calls."""

    name: str  # vLLM's --tool-call-parser for the same syntax
    opens: str  # opens a call in the output (plain text); its presence in the template identifies the syntax
    closes: str  # closes one call; several calls may follow each other


# Mistral's [TOOL_CALLS] is not here: it is a control token, which the answer's text (and a grammar's) never
# shows, so calls could not be found in the text.
SYNTAXES: tuple[ToolSyntax, ...] = (
    ToolSyntax("hermes", "<tool_call>", "</tool_call>"),  # Qwen 2.5/3, Hermes, SmolLM3
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def as_openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def _renders_tools(template: str | None) -> bool:
    return bool(template and re.search(r"\btools\b", template))


def syntax_in(template: str | None) -> ToolSyntax | None:
    """The syntax ``template`` teaches, if it renders tools in one tuneport knows."""
    if not _renders_tools(template):
        return None
    return next((s for s in SYNTAXES if s.opens in template), None)


def template_of(model_dir: Path) -> str | None:
    """An HF model directory's chat template (``chat_template.jinja``, else ``tokenizer_config.json``)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        value = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, list):  # named templates: the tool-use one where there is one
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("tool_use") or named.get("default")
    return value if isinstance(value, str) else None


def syntax_of(template: str | None) -> ToolSyntax:
    """The tool-call syntax ``template`` teaches; a 400 with the reason when it renders no tools or none of the
    syntaxes tuneport parses."""
    if not _renders_tools(template):
        raise ApiError("'tools' is not honoured: the model's chat template does not render tools",
                       "use a model whose chat template supports tools, or describe them in a message")
    if syntax := syntax_in(template):
        return syntax
    raise ApiError("'tools' is not honoured: the chat template renders tools but asks for calls in a syntax "
                   f"tuneport does not parse (it parses {', '.join(s.name for s in SYNTAXES)})",
                   "serve with --engine vllm and its --tool-call-parser for this model")


def check_tools(tools: object) -> list[dict]:
    """OpenAI ``tools``: a list of {"type": "function", "function": {"name", "parameters"?}}."""
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ApiError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return tools


def forced_names(tool_choice: object, tools: list[dict]) -> list[str] | None:
    """The tools one of which must be called (``required``: any; a named function: that one); None when the
    model may answer in text (``auto``)."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice in (None, "auto"):
        return None
    if tool_choice == "required":
        return names
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ApiError(f"'tool_choice' names {name!r}, which is not among the tools")
        return [name]
    raise ApiError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}")


def call_grammar(syntax: ToolSyntax, tools: list[dict], names: list[str]) -> str:
    """GBNF for exactly one call of one of ``names``, in ``syntax``, its arguments valid for the tool's schema."""
    from .structured import schema_grammar

    params, defs = {}, {}
    for i, t in enumerate(tools):  # each tool's $defs move to the top, its references renamed to follow them
        schema, mine = _hoist_defs(t["function"].get("parameters") or {"type": "object"}, f"tool{i}_")
        params[t["function"]["name"]] = schema
        defs.update(mine)
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                         "required": ["name", "arguments"], "additionalProperties": False} for n in names]}
    if defs:
        schema["$defs"] = defs
    body = re.sub(r"^root ::=", "call ::=", schema_grammar(schema), count=1, flags=re.M)
    return f"root ::= {json.dumps(syntax.opens + chr(10))} call {json.dumps(chr(10) + syntax.closes)}\n{body}"


def _hoist_defs(schema: dict, prefix: str) -> tuple[dict, dict]:
    """``schema`` without its ``$defs``/``definitions`` (returned apart, renamed with ``prefix``), every local
    reference rewritten to ``#/$defs/<prefix><name>``: a tool's schema nested in the call schema keeps its refs."""
    schema = dict(schema)
    defs = {**schema.pop("$defs", {}), **schema.pop("definitions", {})}

    def rewrite(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                m = re.fullmatch(r"#/(?:\$defs|definitions)/(.+)", ref)
                if not m:
                    raise ApiError(f"a tool's parameters use $ref {ref!r}: only #/$defs/... references can be forced")
                node = {**node, "$ref": f"#/$defs/{prefix}{m.group(1)}"}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    return rewrite(schema), {f"{prefix}{k}": rewrite(v) for k, v in defs.items()}


def parse_calls(text: str, syntax: ToolSyntax) -> list[ToolCall] | None:
    """The calls in ``text`` (which starts where ``syntax.opens`` was found); None when they do not parse — the
    text is then returned as content, as vLLM does."""
    try:
        items = []
        for chunk in text.split(syntax.opens)[1:]:
            body, closed, rest = chunk.partition(syntax.closes)
            if not closed and body.strip() == "":
                continue
            items.append(json.loads(body.strip()))
            if rest.strip():
                return None
        calls = [ToolCall(i["name"], i.get("arguments", i.get("parameters", {}))) for i in items]
    except (ValueError, KeyError, TypeError):
        return None
    return calls if calls and all(isinstance(c.arguments, dict) and isinstance(c.name, str) for c in calls) else None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: a tool call's ``arguments`` as an object, not a string."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise ApiError("a tool call's 'arguments' is not JSON") from None
                calls.append({**c, "function": fn, **fn})  # Qwen-style templates read name/arguments at the top
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
