"""The OpenAI request bodies the in-process engines answer, as typed models: one per endpoint over shared
sampling fields. Which fields an engine honours is :mod:`tuneport.serve.openai_fields` (checked first, for
every engine); these models type the values (a bad one is a 400 naming the field). vLLM validates its own.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, field_validator

from .errors import ApiError

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit

Finite = Annotated[float, Field(allow_inf_nan=False)]


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def _prompt(value: object) -> object:
    """A completion prompt's shape, in one pass over it: a union of list types would have pydantic try each, with
    an error object per element for each shape it is not (40x a 900 KiB body in memory, measured)."""
    if isinstance(value, str) or _token_ids(value):
        return value
    if isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(_token_ids(p) for p in value)):
        return value
    raise ValueError("not a prompt")


Prompt = Annotated[str | list, PlainValidator(_prompt)]  # a string, token ids, or a list of either


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)  # strict: no "0.5" or true for a number

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[Finite, Field(ge=0)] = 1.0
    top_p: Annotated[Finite, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_prompt: bool = True  # llama-server's field: may the engine reuse and keep this prompt's KV cells
    response_format: dict[str, Any] | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _null_is_default(cls, v: object, info) -> object:
        return cls.model_fields[info.field_name].default if v is None else v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingRequest):
    prompt: Prompt = ""
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def top_k(self) -> int | None:
        """Alternatives per token asked for (None: no log-probabilities)."""
        return self.logprobs


class ChatRequest(SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _message_shapes(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a chat template may index: a role string, content text (or a list of parts), tool calls as
        objects with a function object (anything else was a template crash, a 500)."""
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} needs a 'role' string")
            content = m.get("content")
            if content is not None and not isinstance(content, str) and not (
                    isinstance(content, list) and all(isinstance(part, dict) for part in content)):
                raise ValueError(f"message {i}'s 'content' must be a string or a list of content parts")
            calls = m.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
                raise ValueError(f"message {i}'s 'tool_calls' must be a list of objects with a 'function' object")
        return messages

    def top_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true")
        return (self.top_logprobs or 0) if self.logprobs else None


# what a field accepts, said whole (a union type would otherwise speak with its first shape's complaint)
SHAPES = {"prompt": "a string, a list of token ids (each >= 0), or a list of either",
          "stop": "a string or a list of strings", "tool_choice": "a string or an object",
          "max_tokens": "an integer >= 0", "max_completion_tokens": "an integer >= 0", "seed": "an integer >= 0"}
LOGPROBS_SHAPE = {"completions": f"an integer from 0 to {MAX_LOGPROBS}", "chat": "true or false"}


def parse_request(kind: str, body: dict) -> CompletionRequest | ChatRequest:
    """``body`` as the endpoint's model; the first problems as one 400 naming each field."""
    model = ChatRequest if kind == "chat" else CompletionRequest
    shapes = {**SHAPES, "logprobs": LOGPROBS_SHAPE[kind]}
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None or k == "messages"})
    except ValidationError as e:
        first: dict[str, str] = {}
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "body"
            first.setdefault(name, f"must be {shapes[name]}" if name in shapes
                             else err["msg"].removeprefix("Value error, "))
        raise ApiError("; ".join(f"'{f}' {msg}" if msg.startswith("must") else f"'{f}': {msg}"
                                 for f, msg in list(first.items())[:3])) from None
