"""The OpenAI answering of every engine that generates tokens in this process (llama.cpp, MLX).

An :class:`InProcessBackend` turns a request body into prompt tokens (a completion prompt, or chat
messages through the model's chat template), runs it on its engine, and builds the answer: text from
token bytes (UTF-8 assembled across tokens), stop strings (held back while they may still be forming),
``finish_reason``, usage, streaming as server-sent events, ``return_token_ids``. A subclass says how its
engine tokenizes, renders chat, spells a token and generates.
"""

from __future__ import annotations

import codecs
import contextlib
import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncIterator, Iterator

from starlette.concurrency import run_in_threadpool

from .contract import Backend, Kind, Usage, number
from .engines.base import GenerationRequest
from .errors import ApiError
from .http import SSE_DONE, sse


class InProcessBackend(Backend):
    """A backend over an in-process token engine; subclasses implement the four engine hooks below."""

    @classmethod
    def start(cls, opts, **engine_options) -> InProcessBackend:
        """The backend for ``opts`` (base, pool) with ``engine_options``, its start-up adapters loaded; closed
        again if one of them fails."""
        from tuneport.convert.adapter import resolve_adapter_path

        startup = opts.startup_adapters(must_fit=opts.pin)
        backend = cls(opts.base, max_adapters=opts.max_adapters, adapter_dir=opts.adapter_dir, **engine_options)
        try:
            for name, path in startup.items():
                backend.pool.add(name, resolve_adapter_path(path), pinned=opts.pin, trusted=True)
        except BaseException:
            backend.close()
            raise
        return backend

    # -- engine hooks -------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """A completion prompt as token ids (BOS as the model wants it, special tokens parsed)."""

    @abstractmethod
    def render_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages through the model's chat template, as token ids (ApiError if it has none)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds (prompt ids are checked against it)."""

    @abstractmethod
    def piece(self, token: int) -> bytes:
        """The bytes one generated token adds to the text (special tokens: none)."""

    @abstractmethod
    def run(self, request: GenerationRequest) -> Iterator[int]:
        """The engine's tokens for ``request``; closing the iterator cancels it."""

    # -- requests ------------------------------------------------------------------------------------
    def prompt_tokens(self, kind: Kind, body: dict) -> list[int]:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError("messages must be a non-empty list")
            return self.render_chat(messages)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:  # an engine reads its embedding at whatever index it is given
                raise ApiError(f"token ids {bad[:3]} are outside the vocabulary (0 to {self.vocab_size - 1})")
            return list(prompt)
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        raise ApiError("prompt must be a string or a list of token ids")

    def _text(self, req: GenerationRequest, stops: list[str], token_ids: list[int] | None, usage: Usage
              ) -> Iterator[tuple[str, str | None]]:
        """(text delta, finish reason or None), cut at the first stop string; runs in a worker thread."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, sent, stopped = "", 0, False
        hold = max((len(s) - 1 for s in stops if s), default=0)  # a stop string may still be forming
        for tok in self.run(req):
            usage.completion_tokens += 1
            if token_ids is not None:
                token_ids.append(tok)
            seen = max(0, len(text) - hold)  # no stop string ends before here: earlier text was searched
            text += decoder.decode(self.piece(tok))
            hit = next((at for s in stops if s and (at := text.find(s, seen)) >= 0), -1)
            if hit >= 0:
                text, stopped = text[:hit], True
                break
            if len(text) - hold > sent:
                yield text[sent: len(text) - hold], None
                sent = len(text) - hold
        finish = "length" if not stopped and usage.completion_tokens >= req.max_tokens else "stop"
        yield text[sent:], finish

    def _start(self, kind: Kind, body: dict, usage: Usage) -> tuple[GenerationRequest, dict[str, float], list]:
        """Parse the request: the engine request, the adapters it needs, its stop strings."""
        adapters = self.adapters_for(body)
        prompt = self.prompt_tokens(kind, body)
        usage.prompt_tokens = len(prompt)
        seed = body.get("seed")
        req = GenerationRequest(
            prompt_tokens=prompt, adapters=adapters,
            max_tokens=int(number(body, "max_completion_tokens", number(body, "max_tokens", 16, int), int)),
            temperature=number(body, "temperature", 1.0), top_p=number(body, "top_p", 1.0),
            seed=None if seed is None else int(number(body, "seed", 0, int)),
            ignore_eos=bool(body.get("ignore_eos", False)))
        for bad, what in ((req.temperature < 0, "temperature must be >= 0"),
                          (not 0 < req.top_p <= 1, "top_p must be in (0, 1]"),
                          (req.seed is not None and req.seed < 0, "seed must be >= 0"),
                          (req.max_tokens < 0, "max_tokens must be >= 0")):
            if bad:
                raise ApiError(what)
        stops = body.get("stop") or []
        return req, adapters, [stops] if isinstance(stops, str) else list(stops)

    async def _pieces(self, req: GenerationRequest, stops: list[str], usage: Usage,
                      token_ids: list[int] | None = None) -> AsyncIterator[tuple[str, str | None]]:
        """The text deltas of ``req``, each produced in a worker thread; stopping early cancels the request."""
        it = self._text(req, stops, token_ids, usage)
        try:
            while (item := await run_in_threadpool(next, it, None)) is not None:
                yield item
        finally:
            it.close()  # the engine drops the sequence at its next step

    async def generate(self, kind: Kind, body: dict, usage: Usage) -> dict:
        req, adapters, stops = self._start(kind, body, usage)
        ids: list[int] = []
        text, finish = "", None
        with await self.hold(adapters):  # released only after the engine has dropped the request
            async with contextlib.aclosing(self._pieces(req, stops, usage, ids)) as pieces:
                async for delta, fin in pieces:
                    text += delta
                    finish = fin or finish
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        extra = {}
        if body.get("return_token_ids"):  # vLLM's extension: the prompt's and the answer's token ids
            choice["token_ids"] = ids
            extra["prompt_token_ids"] = req.prompt_tokens
        return {"id": response_id(kind), "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.name, "choices": [choice],
                "usage": usage.as_dict(), **extra}

    async def stream(self, kind: Kind, body: dict, usage: Usage) -> AsyncIterator[bytes]:
        req, adapters, stops = self._start(kind, body, usage)
        head = {"id": response_id(kind), "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.name}
        first = True
        with await self.hold(adapters):  # released only after the engine has dropped the request
            async with contextlib.aclosing(self._pieces(req, stops, usage)) as pieces:
                async for delta, finish in pieces:
                    if kind == "chat":
                        d = {"role": "assistant", "content": delta} if first else {"content": delta}
                        choice = {"index": 0, "delta": d, "finish_reason": finish}
                    else:
                        choice = {"index": 0, "text": delta, "finish_reason": finish}
                    first = False
                    yield sse({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):  # OpenAI: a last chunk with usage only
            yield sse({**head, "choices": [], "usage": usage.as_dict()})
        yield SSE_DONE


def response_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
