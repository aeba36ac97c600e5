"""What an in-process engine is asked for and what it answers: shared by the llama.cpp and MLX engines.

An in-process engine turns a :class:`GenerationRequest` (prompt token ids, adapters, sampling, ``n`` choices,
log-probabilities, a grammar) into events one at a time — a :class:`Step` per generated token, the prompt's
:class:`PromptScores` when asked, a :class:`Done` per choice; text, stop strings and the OpenAI answer are
built over them by :class:`tuneport.serve.backends.inprocess.InProcessBackend`.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

TopLogprobs = tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass
class GenerationRequest:
    """One generation: prompt tokens, the adapter set (name -> scale; {} = the base), sampling, and what to
    report. ``logprobs``: None reports none, k >= 0 the chosen token's log-probability and the k most likely
    alternatives; ``prompt_logprobs`` scores every prompt token after the first (what ``echo`` needs);
    ``grammar``: a GBNF grammar the output must match (llama.cpp)."""

    prompt_tokens: list[int]
    adapters: dict[str, float] = field(default_factory=dict)
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: bool = False
    grammar: str | None = None
    cache_prompt: bool = True  # an engine with a prompt cache may reuse (and keep) this prompt's cells


@dataclass(frozen=True)
class Step:
    """One generated token of choice ``index``, with its log-probability under the raw logits when asked."""

    index: int
    token: int
    logprob: float | None = None
    top: TopLogprobs | None = None


@dataclass(frozen=True)
class PromptScores:
    """The log-probability (and top alternatives) of each prompt token after the first, under the raw logits."""

    logprobs: list[float]
    top: list[TopLogprobs] | None


@dataclass(frozen=True)
class Done:
    """Choice ``index`` has ended (stop token, end of generation, max_tokens, or cancelled)."""

    index: int


Event = Step | PromptScores | Done


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, TopLogprobs]:
    """log-softmax of one row of logits at ``token`` and its ``k`` most likely tokens (float64 sums)."""
    z = logits.astype(np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    top: TopLogprobs = ()
    if k > 0:
        ids = np.argpartition(-z, k - 1)[:k] if k < len(z) else np.arange(len(z))
        ids = ids[np.argsort(-z[ids], kind="stable")]
        top = tuple((int(i), float(z[i] - lse)) for i in ids)
    return float(z[token] - lse), top


@dataclass(eq=False)
class Sequence:
    """One choice of one request inside an engine: the engine thread puts its events on ``out`` (shared by the
    request's choices; an exception is for the caller), and drops it at its next step once ``cancelled``."""

    req: GenerationRequest
    out: queue.Queue = field(default_factory=queue.Queue)
    index: int = 0
    last: int = 0  # the token to feed next
    n_out: int = 0
    cancelled: bool = False
    group: list[Sequence] = field(default_factory=list)  # the request's choices, this one included

    def __post_init__(self) -> None:
        # each choice its own stream: n choices with one seed differ and are reproducible
        seed = self.req.seed if self.req.seed is None or self.req.n == 1 else [self.req.seed, self.index]
        self.rng = np.random.default_rng(seed)
        if not self.group:
            self.group = [self]

    @classmethod
    def choices(cls, req: GenerationRequest, **fields) -> list[Sequence]:
        """The ``req.n`` choices of ``req``, sharing one queue (extra ``fields`` for an engine's subclass)."""
        out: queue.Queue = queue.Queue()
        group = [cls(req, out=out, index=i, **fields) for i in range(max(1, req.n))]
        for s in group:
            s.group = group
        return group

    def emit(self, tok: int, end_of_generation: bool, logits: np.ndarray | None = None) -> bool:
        """The engine's side: hand ``tok`` to the caller unless the request ends with it (cancelled, a stop
        token, end of generation unless ignored) or after it (max_tokens). True when finished (Done sent).
        ``logits`` (the raw row ``tok`` was sampled from) gives its log-probabilities when they were asked."""
        done = self.cancelled or tok in self.req.stop_tokens or (end_of_generation and not self.req.ignore_eos)
        if not done:
            lp, top = (token_logprobs(logits, tok, self.req.logprobs)
                       if self.req.logprobs is not None and logits is not None else (None, None))
            self.out.put(Step(self.index, tok, lp, top))
            self.last, self.n_out = tok, self.n_out + 1
            done = self.n_out >= self.req.max_tokens
        if done:
            self.out.put(Done(self.index))
        return done

    def events(self) -> EventStream:
        """The caller's side: the request's events (all its choices) as the engine produces them."""
        return EventStream(self.group)


class EventStream:
    """The events of one request until every choice is done. ``cancel(i)`` ends choice ``i`` (the engine drops
    it at its next step); ``close()`` ends them all, whether or not iteration began."""

    def __init__(self, group: list[Sequence]) -> None:
        self.group = group
        self.open = len(group)

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> Event:
        if self.open <= 0:
            raise StopIteration
        item = self.group[0].out.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if isinstance(item, Done):
            self.open -= 1
        return item

    def cancel(self, index: int) -> None:
        self.group[index].cancelled = True

    def close(self) -> None:
        self.open = 0
        for s in self.group:
            s.cancelled = True


def tokens_of(events: Iterator[Event]) -> Iterator[int]:
    """The tokens of choice 0 among ``events`` (the simple view tests and single-choice callers want)."""
    try:
        for e in events:
            if isinstance(e, Step) and e.index == 0:
                yield e.token
    finally:
        close = getattr(events, "close", None)
        if close:
            close()


class TokenEngine(Protocol):
    """An engine running in this process: token ids in, events out."""

    def events(self, request: GenerationRequest) -> Iterator[Event]:
        """The request's events one at a time; closing the iterator cancels the request."""

    def generate(self, request: GenerationRequest) -> Iterator[int]:
        """The tokens of choice 0 one at a time; closing the iterator cancels the request."""

    def close(self) -> None:
        """Stop and free everything."""


class AdapterEngine:
    """What the in-process engines with named adapters share: ``_loaded`` (name -> what the engine holds for
    it), listed by ``adapters``; ``generate`` as the tokens of the subclass's ``events``."""

    _loaded: dict
    events: Callable[[GenerationRequest], Iterator[Event]]

    @property
    def adapters(self) -> list[str]:
        return list(self._loaded)

    def generate(self, request: GenerationRequest) -> Iterator[int]:
        """Tokens one at a time for ``request``; closing the iterator cancels it."""
        return tokens_of(self.events(request))


def sample(logits: np.ndarray, request: GenerationRequest, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax at temperature 0, else temperature and top-p."""
    if request.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    z = (z - z.max()) / request.temperature  # max first: a tiny temperature gives -inf, never inf - inf
    p = np.exp(z)
    p /= p.sum()
    if request.top_p < 1.0:
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), request.top_p) + 1)]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(len(p), p=p))
