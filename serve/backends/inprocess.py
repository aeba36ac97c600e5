"""The OpenAI answering of every engine that generates tokens in this process (llama.cpp, MLX).

An :class:`InProcessBackend` turns a request body into engine requests — each completion prompt (a string,
token ids, or a list of them), or chat messages through the model's chat template (with ``tools`` where the
template renders them) — runs them on its engine with ``n`` choices each, log-probabilities, an echoed and
scored prompt, a grammar for ``response_format`` or a forced tool call, and builds the answer with
:mod:`tuneport.serve.openai_choices`: whole, or streamed as server-sent events. A subclass says how its engine
tokenizes, renders chat, spells a token and runs a request.
"""

from __future__ import annotations

import codecs
import contextlib
import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from ..backend import Backend, Kind, Usage
from ..engines.base import Event, GenerationRequest, PromptScores, Step
from ..errors import ApiError
from ..http import SSE_DONE, sse
from ..openai_choices import ChoiceBuilder, Delta, Scored, chat_logprobs, completion_logprobs
from ..openai_request import ChatRequest, CompletionRequest, parse_request
from ..structured import grammar_for
from ..tool_calls import ToolSyntax, call_grammar, check_tools, forced_names, syntax_of, template_messages


@dataclass
class Plan:
    """A parsed request: one engine request per prompt, and how its choices are answered."""

    kind: Kind
    request: CompletionRequest | ChatRequest  # the body, typed
    requests: list[GenerationRequest]
    echoes: list[str]  # per prompt: its text when echoed, else ""
    adapters: dict[str, float]
    stops: list[str]
    logprobs: int | None  # alternatives per token (None: no log-probabilities)
    tools: ToolSyntax | None = None
    choices: list[ChoiceBuilder] = field(default_factory=list)


class InProcessBackend(Backend):
    """A backend over an in-process token engine; subclasses implement the engine hooks below."""

    max_choices = 1  # the most choices (n) one request may ask for
    default_max_tokens = 16  # OpenAI's completions default, for chat too
    max_prompt_tokens: int | None = None  # --max-prompt-tokens: a longer prompt answers 400
    chat_template: str | None = None  # the chat template's source (tools are honoured where it renders them)

    @classmethod
    def start(cls, opts, **engine_options) -> InProcessBackend:
        """The backend for ``opts`` (base, pool) with ``engine_options``, its start-up adapters loaded; closed
        again if one of them fails."""
        from tuneport.convert.adapter import resolve_adapter_path

        startup = opts.startup_adapters(must_fit=opts.pin)
        backend = cls(opts.base, max_adapters=opts.max_adapters, adapter_dir=opts.adapter_dir, **engine_options)
        backend.max_prompt_tokens = opts.max_prompt_tokens
        try:
            for name, path in startup.items():
                backend.pool.add(name, resolve_adapter_path(path), pinned=opts.pin, trusted=True)
        except BaseException:
            backend.close()
            raise
        return backend

    # -- engine hooks -------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """A prompt's text as token ids, special tokens parsed; BOS as the model wants it for a completion prompt
        (``add_bos`` None), or as :meth:`render_chat` said for a rendered chat."""

    @abstractmethod
    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, bool]:
        """Chat messages (and tools) through the model's chat template: the text, and whether tokenizing it adds
        BOS (ApiError if the model has no template or it cannot render them)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds (prompt ids are checked against it)."""

    @property
    @abstractmethod
    def n_ctx(self) -> int:
        """Tokens per sequence, prompt and answer together."""

    @abstractmethod
    def token_bytes_bound(self) -> int:
        """An upper bound on the bytes of text one token stands for, special tokens' text included."""

    @property
    def prompt_token_limit(self) -> int:
        return min(self.n_ctx, self.max_prompt_tokens or self.n_ctx)

    def longest_token_bytes(self) -> int:
        if self._longest_token is None:
            self._longest_token = self.token_bytes_bound()  # once, at the first prompt long enough to need it
        return self._longest_token

    _longest_token: int | None = None

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages as the prompt's token ids (what a chat request is answered from)."""
        return self.tokenize(*self.render_chat(messages, tools))

    @abstractmethod
    def piece(self, token: int) -> bytes:
        """The bytes one token adds to the text (special tokens: none)."""

    @abstractmethod
    def run(self, request: GenerationRequest) -> Iterator[Event]:
        """The engine's events for ``request``, submitted at once; ``close()`` on the result cancels it."""

    # -- requests ------------------------------------------------------------------------------------
    def prompts(self, prompt: str | list, echo: bool) -> list[tuple[list[int], str]]:
        """A completion's prompts (typed by the request model: a string, token ids, or a list of either) as
        (token ids, the text echoed: "" unless ``echo``)."""
        items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        for text in (p for p in items if isinstance(p, str)):  # every prompt bounded before any is tokenized
            self.check_prompt_bytes(utf8_length(text))
        out = []
        for p in items:
            if isinstance(p, str):
                out.append((self.tokenize(p), p if echo else ""))
                continue
            if not p:
                raise ApiError("prompt must not be empty")
            if len(p) > self.n_ctx:  # before its ids are looked at
                raise ApiError(f"the prompt is {len(p)} tokens, more than the context of {self.n_ctx} holds",
                               "shorten the prompt")
            bad = [t for t in p if t >= self.vocab_size]
            if bad:  # an engine reads its embedding at whatever index it is given
                raise ApiError(f"token ids {bad[:3]} are outside the vocabulary (0 to {self.vocab_size - 1})")
            out.append((list(p), b"".join(self.piece(t) for t in p).decode("utf-8", "replace") if echo else ""))
        return out

    def _tools(self, r: ChatRequest) -> tuple[list[dict] | None, ToolSyntax | None, str | None]:
        """(tools to render, the syntax to parse calls in, a grammar forcing a call) for a chat request."""
        if not r.tools:
            if r.tool_choice not in (None, "none"):
                raise ApiError("'tool_choice' needs 'tools'")
            return None, None, None
        tools = check_tools(r.tools)
        syntax = syntax_of(self.chat_template)
        if r.tool_choice == "none":  # the model sees the tools (as vLLM renders them) but calls none
            return tools, None, None
        names = forced_names(r.tool_choice, tools)
        return tools, syntax, call_grammar(syntax, tools, names) if names else None

    def plan(self, kind: Kind, body: dict, usage: Usage) -> Plan:
        """Parse the request: the engine requests, the adapters they need, how their choices are answered."""
        adapters = self.adapters_for(body)
        r = parse_request(kind, body)
        if r.n > self.max_choices:
            raise ApiError(f"'n' must be between 1 and {self.max_choices} on this engine")
        logprobs = r.top_k()
        echo = isinstance(r, CompletionRequest) and r.echo
        grammar = grammar_for(r.response_format)
        syntax = None
        if isinstance(r, ChatRequest):
            tools, syntax, forced = self._tools(r)
            if forced and grammar:
                raise ApiError("'response_format' and a forced 'tool_choice' both constrain the output",
                               "send one of them")
            grammar = grammar or forced
            text, add_bos = self.render_chat(template_messages(r.messages), tools)
            self.check_prompt_bytes(utf8_length(text))  # rendered (cheap), bounded, and only then tokenized
            prompts = [(self.tokenize(text, add_bos), "")]
            max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        else:
            prompts = self.prompts(r.prompt, echo)
            max_tokens = r.max_tokens
        base = dict(adapters=adapters, n=r.n, logprobs=logprobs, prompt_logprobs=echo and logprobs is not None,
                    grammar=grammar, max_tokens=self.default_max_tokens if max_tokens is None else max_tokens,
                    temperature=r.temperature, top_p=r.top_p, seed=r.seed, ignore_eos=r.ignore_eos,
                    cache_prompt=r.cache_prompt)
        longest = max(len(ids) for ids, _ in prompts)
        if self.max_prompt_tokens is not None and longest > self.max_prompt_tokens:
            raise ApiError(f"the prompt is {longest} tokens, over this server's limit of {self.max_prompt_tokens} "
                           "(--max-prompt-tokens)", "shorten the prompt")
        usage.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        return Plan(kind, r, [GenerationRequest(prompt_tokens=ids, **base) for ids, _ in prompts],
                    [text for _, text in prompts], adapters, r.stops, logprobs, syntax)

    # -- answering -----------------------------------------------------------------------------------
    def _deltas(self, plan: Plan, usage: Usage) -> Iterator[tuple[ChoiceBuilder, Delta]]:
        """Every choice's deltas as its events arrive (runs in a worker thread); closing it cancels all."""
        streams = []
        try:
            for req in plan.requests:  # all submitted before any is read: the engine batches them
                streams.append(self.run(req))
            for p, (req, stream) in enumerate(zip(plan.requests, streams, strict=True)):
                mine = [ChoiceBuilder(p * req.n + i, self.piece, plan.stops, req.max_tokens, plan.tools,
                                      plan.echoes[p]) for i in range(req.n)]
                plan.choices += mine
                if req.max_tokens == 0 and not req.prompt_logprobs:
                    for b in mine:
                        yield b, b.end()
                    continue
                for e in stream:
                    if isinstance(e, PromptScores):
                        scored = self._prompt_scored(req, e)
                        for b in mine:
                            b.prelude(scored)
                    elif isinstance(e, Step):
                        b = mine[e.index]
                        usage.completion_tokens += not b.stopped  # the token completing a stop string counts
                        d = b.step(e)
                        if b.stopped:
                            stream.cancel(e.index)
                        if d is not None:
                            yield b, d
                    else:
                        yield mine[e.index], mine[e.index].end()
        finally:
            for stream in streams:
                stream.close()  # the engine drops the sequences at its next step

    def _prompt_scored(self, req: GenerationRequest, scores: PromptScores) -> list[Scored]:
        """The prompt's tokens with their scores; offsets into the prompt's text as its tokens decode together
        (a character split across tokens counted once, where it completes)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offsets, at = [], 0
        for t in req.prompt_tokens:
            offsets.append(at)
            at += len(decoder.decode(self.piece(t)))
        tops = scores.top or [None] * len(scores.logprobs)
        return [Scored(req.prompt_tokens[0], None, None, 0)] + [
            Scored(t, lp, top, off) for t, lp, top, off in
            zip(req.prompt_tokens[1:], scores.logprobs, tops, offsets[1:], strict=True)]

    async def _run_deltas(self, plan: Plan, usage: Usage) -> AsyncIterator[tuple[ChoiceBuilder, Delta]]:
        it = self._deltas(plan, usage)
        try:
            while (item := await run_in_threadpool(next, it, None)) is not None:
                yield item
        finally:
            await run_in_threadpool(it.close)

    def _whole(self, plan: Plan, usage: Usage) -> dict[int, Delta]:
        """Every choice's deltas joined (runs in one worker thread: no hop back to the event loop per token)."""
        got: dict[int, Delta] = {}
        with contextlib.closing(self._deltas(plan, usage)) as deltas:
            for b, d in deltas:
                whole = got.setdefault(b.index, Delta())
                whole.text += d.text
                whole.scored += d.scored
                whole.finish, whole.tool_calls = d.finish or whole.finish, d.tool_calls or whole.tool_calls
        return got

    async def generate(self, kind: Kind, body: dict, usage: Usage) -> dict:
        plan = self.plan(kind, body, usage)
        with await self.hold(plan.adapters):  # released only after the engine has dropped the request
            got = await run_in_threadpool(self._whole, plan, usage)
        choices = [self._choice(plan, b, got.get(b.index, Delta()))
                   for b in sorted(plan.choices, key=lambda b: b.index)]
        extra = {"prompt_token_ids": plan.requests[0].prompt_tokens} if plan.request.return_token_ids else {}
        return {"id": response_id(kind), "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": plan.request.model or self.name, "choices": choices,
                "usage": usage.as_dict(), **extra}

    def _choice(self, plan: Plan, b: ChoiceBuilder, d: Delta) -> dict:
        text, scored, finish, calls = d.text, d.scored, d.finish, d.tool_calls
        if plan.kind == "chat":
            message = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            choice = {"index": b.index, "message": message,
                      "logprobs": chat_logprobs(scored, self.piece) if plan.logprobs is not None else None,
                      "finish_reason": finish}
        else:
            choice = {"index": b.index, "text": text,
                      "logprobs": (completion_logprobs(scored, self.piece, plan.logprobs)
                                   if plan.logprobs is not None else None), "finish_reason": finish}
        if plan.request.return_token_ids:  # vLLM's extension: the answer's token ids
            choice["token_ids"] = b.token_ids
        return choice

    async def stream(self, kind: Kind, body: dict, usage: Usage) -> AsyncIterator[bytes]:
        plan = self.plan(kind, body, usage)
        head = {"id": response_id(kind), "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": plan.request.model or self.name}
        started: set[int] = set()
        with await self.hold(plan.adapters):  # released only after the engine has dropped the request
            async with contextlib.aclosing(self._run_deltas(plan, usage)) as deltas:
                async for b, d in deltas:
                    first = b.index not in started
                    started.add(b.index)
                    yield sse({**head, "choices": [self._chunk(plan, b, d, first)]})
        options = plan.request.stream_options
        if options and options.include_usage:  # OpenAI: a last chunk with usage only
            yield sse({**head, "choices": [], "usage": usage.as_dict()})
        yield SSE_DONE

    def _chunk(self, plan: Plan, b: ChoiceBuilder, d: Delta, first: bool) -> dict:
        text = d.text
        if plan.kind == "chat":
            delta: dict = {"role": "assistant"} if first else {}
            if text or (first and not d.tool_calls):
                delta["content"] = text  # OpenAI: no content key once there is none to add; null beside a call
            elif first:
                delta["content"] = None
            if d.tool_calls:
                delta["tool_calls"] = [{"index": i, **c.as_openai()} for i, c in enumerate(d.tool_calls)]
            lp = chat_logprobs(d.scored, self.piece) if plan.logprobs is not None else None
            return {"index": b.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish}
        lp = completion_logprobs(d.scored, self.piece, plan.logprobs) if plan.logprobs is not None else None
        return {"index": b.index, "text": text, "logprobs": lp, "finish_reason": d.finish}


def utf8_length(text: str) -> int:
    """The bytes of ``text`` in UTF-8 (a lone surrogate, which JSON can carry, counted as its three bytes)."""
    return len(text.encode("utf-8", "surrogatepass"))


def response_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
