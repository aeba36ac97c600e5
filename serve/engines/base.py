"""What an in-process engine is asked for and how it picks a token: shared by the llama.cpp and MLX engines.

An in-process engine turns a :class:`GenerationRequest` (prompt token ids, adapters, sampling) into token
ids one at a time; text, stop strings and the OpenAI answer are built over it by
:class:`tuneport.serve.inprocess.InProcessBackend`.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass
class GenerationRequest:
    """One generation: prompt tokens, the adapter set (name -> scale; {} = the base), sampling."""

    prompt_tokens: list[int]
    adapters: dict[str, float] = field(default_factory=dict)
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(eq=False)
class Sequence:
    """One request inside an engine: the engine thread puts its tokens on ``out`` (then None, or an exception
    for the caller), and drops it at its next step once ``cancelled``."""

    req: GenerationRequest
    out: queue.Queue = field(default_factory=queue.Queue)
    last: int = 0  # the token to feed next
    n_out: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.req.seed)

    def emit(self, tok: int, end_of_generation: bool) -> bool:
        """The engine's side: hand ``tok`` to the caller unless the request ends with it (cancelled, a stop
        token, end of generation unless ignored) or after it (max_tokens). True when finished (None sent)."""
        done = self.cancelled or tok in self.req.stop_tokens or (end_of_generation and not self.req.ignore_eos)
        if not done:
            self.out.put(tok)
            self.last, self.n_out = tok, self.n_out + 1
            done = self.n_out >= self.req.max_tokens
        if done:
            self.out.put(None)
        return done

    def tokens(self) -> Iterator[int]:
        """The caller's side: tokens as the engine produces them; closing it cancels the request."""
        try:
            while (item := self.out.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancelled = True


class TokenEngine(Protocol):
    """An engine running in this process: token ids in, token ids out."""

    def generate(self, request: GenerationRequest) -> Iterator[int]:
        """The generated tokens one at a time; closing the iterator cancels the request."""

    def close(self) -> None:
        """Stop and free everything."""


def sample(logits: np.ndarray, request: GenerationRequest, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax at temperature 0, else temperature and top-p."""
    if request.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / request.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if request.top_p < 1.0:
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), request.top_p) + 1)]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(len(p), p=p))
