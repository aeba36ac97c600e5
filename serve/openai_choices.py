"""Engine events into OpenAI choices: text from token bytes (UTF-8 assembled across tokens), stop strings
(held back while they may still be forming), a tool call held back from the content once its syntax opens,
log-probabilities in the completions and the chat shapes, ``finish_reason``.

A :class:`ChoiceBuilder` follows one choice; each ``step`` gives what may be sent now (a :class:`Delta`),
``end`` the rest. The same deltas make the streamed chunks and, joined, the whole answer.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from .engines.base import Step, TopLogprobs
from .tool_calls import ToolCall, ToolSyntax, parse_calls


@dataclass(frozen=True)
class Scored:
    """One token of the answer with its log-probability: ``offset`` is where its text starts in the choice."""

    token: int
    logprob: float | None
    top: TopLogprobs | None
    offset: int


@dataclass
class Delta:
    text: str = ""
    scored: list[Scored] = field(default_factory=list)
    finish: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChoiceBuilder:
    """One choice's text and log-probabilities as its tokens arrive."""

    def __init__(self, index: int, piece: Callable[[int], bytes], stops: list[str], max_tokens: int,
                 tools: ToolSyntax | None = None, text: str = "") -> None:
        self.index, self.piece, self.max_tokens, self.tools = index, piece, max_tokens, tools
        self.stops = [s for s in stops if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text, self.sent = text, 0  # ``text``: an echoed prompt, sent first
        self.floor = len(text)  # markers are searched for in the answer only
        markers = self.stops + ([tools.opens] if tools else [])
        self.hold = max((len(s) - 1 for s in markers), default=0)  # a marker may still be forming
        self.n_tokens = 0
        self.stopped = False
        self.call_at = -1  # where a tool call opened: nothing from there is content
        self.pending: list[Scored] = []
        self.token_ids: list[int] = []

    def prelude(self, scored: list[Scored]) -> None:
        """The echoed prompt's scores, sent with the first delta."""
        self.pending += scored

    def step(self, e: Step) -> Delta | None:
        """Take one generated token; what may be sent now (None: nothing yet, or the choice has stopped)."""
        if self.stopped:
            return None
        self.n_tokens += 1
        self.token_ids.append(e.token)
        seen = max(self.floor, len(self.text) - self.hold)  # no marker ends before here: earlier text searched
        if e.logprob is not None:
            self.pending.append(Scored(e.token, e.logprob, e.top, len(self.text)))
        self.text += self.decoder.decode(self.piece(e.token))
        hit = min((at for s in self.stops if (at := self.text.find(s, seen)) >= 0), default=-1)  # the earliest
        if hit >= 0:
            self.text, self.stopped = self.text[:hit], True
            return None
        if self.tools and self.call_at < 0 and (at := self.text.find(self.tools.opens, seen)) >= 0:
            self.call_at = at
        limit = self.call_at if self.call_at >= 0 else len(self.text) - self.hold
        if limit > self.sent:
            d = Delta(self.text[self.sent: limit], self._take())
            self.sent = limit
            return d
        return None

    def end(self) -> Delta:
        """The rest of the choice and why it ended."""
        self.text += self.decoder.decode(b"", final=True) if not self.stopped else ""
        finish = "length" if not self.stopped and self.n_tokens >= self.max_tokens else "stop"
        calls = parse_calls(self.text[self.call_at:], self.tools) if self.call_at >= 0 and self.tools else None
        if calls:
            return Delta(self.text[self.sent: self.call_at], self._take(), "tool_calls", calls)
        return Delta(self.text[self.sent:], self._take(), finish)

    def _take(self) -> list[Scored]:
        taken, self.pending = self.pending, []
        return taken


def completion_logprobs(scored: list[Scored], piece: Callable[[int], bytes], k: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, log-probabilities, top alternatives, offsets."""
    def text(t: int) -> str:
        return piece(t).decode("utf-8", "replace")

    def top(s: Scored) -> dict | None:
        if s.top is None:
            return None
        if k == 0:  # vLLM's answer to logprobs 0: the chosen token alone
            return {text(s.token): s.logprob}
        return {text(t): lp for t, lp in s.top}

    return {"tokens": [text(s.token) for s in scored], "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [top(s) for s in scored], "text_offset": [s.offset for s in scored]}


def chat_logprobs(scored: list[Scored], piece: Callable[[int], bytes]) -> dict:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    def entry(t: int, lp: float) -> dict:
        b = piece(t)
        return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top or ()]}
                        for s in scored], "refusal": None}
