"""The one contract between the gateway and an engine.

A :class:`Backend` answers OpenAI requests (``generate`` and ``stream``, for completions and chat), loads
and unloads adapters through its :class:`~tuneport.serve.pool.AdapterPool`, and reports ``health`` and
``describe``. The gateway depends on this class alone; each engine is one subclass, registered in
:mod:`tuneport.serve.registry`.
"""

from __future__ import annotations

import contextlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from starlette.concurrency import run_in_threadpool

from tuneport.convert.errors import UserError

from .errors import ApiError
from .metrics import Metrics
from .pool import AdapterPool, check_name

Kind = Literal["completions", "chat"]  # /v1/completions or /v1/chat/completions
NORMALIZATION_SLACK = 4  # how many times fewer bytes a tokenizer's normalization may leave of a text (NFKC: 3)


@dataclass
class Usage:
    """Token counts of one request, filled in by the backend as it answers (streams included)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def number(body: dict, key: str, default: float, kind: type = float, field: str | None = None) -> float:
    """``body[key]`` as a number (``default`` when absent or null); a bad value is the client's error (400)
    naming ``field`` (default: ``key``). A string is not a number: float("nan") would pass for one."""
    value = body.get(key)
    if value is None:
        return default
    try:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise TypeError  # JSON's NaN / Infinity are no one's sampling parameters
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ApiError(f"'{field or key}' must be a finite number, not {value!r}") from None


class Backend(ABC):
    """An engine behind the gateway: one served base model plus a pool of adapters.

    Subclasses implement ``generate``, ``stream``, ``attach_adapter``/``detach_adapter`` (what loading
    means for the engine; the pool calls them), ``health``, ``close`` and ``from_options``.
    """

    engine: ClassVar[str]  # the registry name
    weighted_mixes: ClassVar[bool] = False  # whether a request may mix adapters ({"adapters": {name: weight}})
    default_max_tokens: ClassVar[int | None] = None  # tokens a request that names none gets; None: the context

    def __init__(self, name: str, max_adapters: int, adapter_dir: Path | None = None) -> None:
        self.name = name
        self.created = int(time.time())
        self.metrics = Metrics()
        self.pool = AdapterPool(self.attach_adapter, self.detach_adapter, max_adapters, adapter_dir=adapter_dir)

    @classmethod  # noqa: B027 - most engines have nothing to add
    def check_options(cls, opts, fmt: str) -> None:
        """Refuse what this engine cannot do with ``opts`` for a base of format ``fmt`` (before it starts)."""

    @classmethod
    @abstractmethod
    def from_options(cls, opts) -> Backend:
        """Start the engine for ``opts`` (a :class:`tuneport.serve.options.ServeOptions`) with its start-up
        adapters loaded."""

    # -- answering ----------------------------------------------------------------------------------
    @abstractmethod
    async def generate(self, kind: Kind, body: dict, usage: Usage) -> dict:
        """The whole OpenAI response for ``body``; ``usage`` is filled in."""

    @abstractmethod
    def stream(self, kind: Kind, body: dict, usage: Usage) -> AsyncIterator[bytes]:
        """An async generator of server-sent events for ``body``. Every check and every resource it takes
        happens inside it, before its first event: the gateway pulls that event before it answers, so a
        refusal becomes an HTTP error, and a started generator is always closed (adapters released)."""

    # -- adapters -----------------------------------------------------------------------------------
    @abstractmethod
    def attach_adapter(self, name: str, path: Path) -> int:
        """Make ``path`` usable as ``name`` in the engine; return the bytes it occupies (the pool's load)."""

    @abstractmethod
    def detach_adapter(self, name: str) -> None:
        """Free ``name`` in the engine (the pool's unload)."""

    def load_adapter(self, name: str, path: str | Path, pinned: bool = False) -> dict:
        """Load through the pool (capacity, LRU, allowed roots); the adapter's state."""
        return self.pool.add(name, path, pinned=pinned).state()

    def unload_adapter(self, name: str) -> None:
        self.pool.remove(name)

    def adapter_names(self) -> list[str]:
        """The adapters served now (``/v1/models``)."""
        return self.pool.names()

    def adapter_states(self) -> dict:
        """The admin API's listing (``GET /v1/adapters``)."""
        return {"adapters": self.pool.states(), "max_adapters": self.pool.max_adapters}

    def adapters_for(self, body: dict) -> dict[str, float]:
        """OpenAI ``model`` picks the adapter (the base by its own name); ``adapters`` mixes several."""
        mix = body.get("adapters")
        if mix:
            if not self.weighted_mixes:
                raise ApiError(f"weighted adapter mixes ('adapters') are not served by the {self.engine} engine",
                               "pick one adapter with model=NAME, or serve with --engine llamacpp")
            if not isinstance(mix, dict):
                raise ApiError("'adapters' must be an object {name: weight}")
            return {check_name(k): number(mix, k, 1.0, field=f"adapters.{k}") for k in mix}
        model = body.get("model")
        if model in ("", None, self.name):
            return {}
        if not isinstance(model, str):
            raise ApiError("'model' must be a string")
        return {check_name(model): 1.0}

    def check_model(self, body: dict) -> None:
        """Refuse a request for an adapter this server neither holds nor can load (404), before any other work."""
        for name in self.adapters_for(body):
            self.pool.check_known(name)

    # -- prompts ------------------------------------------------------------------------------------
    @property
    def prompt_token_limit(self) -> int | None:
        """The most tokens one prompt may have here (the context, or a tighter limit); None: unknown."""
        return None

    def longest_token_bytes(self) -> int | None:
        """An upper bound on the bytes of text one token stands for (its longest piece); None: unknown."""
        return None

    def check_prompt_bytes(self, nbytes: int) -> None:
        """Refuse (400), before it is tokenized, a prompt of more bytes than :attr:`prompt_token_limit` tokens can
        hold: each token stands for at most :meth:`longest_token_bytes` bytes, times the 4x a normalizing tokenizer
        may shrink text by (NFKC: full-width forms, Hangul jamo)."""
        limit = self.prompt_token_limit
        if limit is None or nbytes <= limit * NORMALIZATION_SLACK:  # no token is shorter than a byte
            return
        longest = self.longest_token_bytes()
        if longest is not None and nbytes > limit * longest * NORMALIZATION_SLACK:
            raise ApiError(f"the prompt is {nbytes} bytes, more than the {limit} tokens a prompt may have here can "
                           f"hold (no token of this model stands for more than {longest} bytes)",
                           "shorten the prompt")

    async def hold(self, names) -> contextlib.ExitStack:
        """Take a pool reference on each adapter (loading it on demand in a worker thread); closing the
        returned stack releases them. No adapter held can be evicted or unloaded meanwhile."""
        stack = contextlib.ExitStack()
        try:
            for name in names:
                entry = self.pool.try_hold(name)  # the common case: loaded, no thread hop
                if entry is not None:
                    stack.callback(self.pool.release, entry)
                else:
                    await run_in_threadpool(stack.enter_context, self.pool.use(name))
        except BaseException:
            stack.close()
            raise
        return stack

    # -- state --------------------------------------------------------------------------------------
    @abstractmethod
    def health(self) -> bool:
        """Whether the engine can answer."""

    def failure(self) -> str | None:
        """Why the engine stopped serving, in its own words; None while it serves. Polled by ``serve``."""
        return None if self.health() else "the engine is not running"

    def restart(self) -> None:
        """Start the engine again after a failure, with the adapters it held (engines that can)."""
        raise UserError(f"--restart-engine: the {self.engine} engine cannot be restarted", "")

    def describe(self) -> dict:
        """What is served: engine, base model, adapters."""
        return {"engine": self.engine, "model": self.name, "adapters": self.pool.names(),
                "max_adapters": self.pool.max_adapters, "weighted_mixes": self.weighted_mixes}

    def counters(self) -> dict[str, int]:
        """Engine figures for /metrics (``*_total``: counters, others: gauges)."""
        return {}

    def metrics_text(self) -> str:
        """``/metrics``: the gateway's request figures, the pool's and the engine's, as Prometheus text."""
        gauges = {k: v for k, v in self.describe().items() if k.endswith("_bytes") and isinstance(v, int)}
        engine = self.counters()
        gauges.update({k: v for k, v in engine.items() if not k.endswith("_total")})
        return self.metrics.render(self.pool.stats, len(self.pool.names()), gauges,
                                   {k: v for k, v in engine.items() if k.endswith("_total")})

    async def aclose(self) -> None:  # noqa: B027 - most engines hold nothing of the event loop
        """Free what belongs to the gateway's event loop (HTTP clients); the gateway calls it when it stops."""

    @abstractmethod
    def close(self) -> None:
        """Stop the engine and free everything it holds."""
