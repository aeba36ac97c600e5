"""MLX LM in this process: one base model, LoRA/DoRA adapters placed at run time, every request with its own
adapter, requests for different adapters decoded together in one batch (mlx-lm's own server reloads the
model to switch adapters).

One worker thread owns every MLX array (MLX streams belong to the thread that made them): it loads the
model, places and removes adapters (:mod:`.mlx_lora`) between steps, and runs continuous batching: a new
request's prompt (all but its last token) is prefilled alone, with its adapter, into its own mlx-lm
``KVCache``; the cache is merged into the running batch's ``BatchKVCache`` (``merge`` / ``extend``); each
step decodes every active row, whatever its adapter, in one forward; finished and cancelled rows leave the
batch (``filter``). Sampling is numpy's, per request (seeded), as in the llama.cpp engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tuneport.convert.errors import UserError
from tuneport.convert.mlx.archs import MLX_ARCHS

from .base import AdapterEngine, Done, Event, EventStream, GenerationRequest, Sequence, sample

log = logging.getLogger("tuneport.serve.mlx")
# The mlx_lm.models modules of tuneport's MLX table: their Model.__call__ is ``self.model(inputs, cache)``
# then the output projection, so a prompt is prefilled through the backbone alone (the cache is all
# prefill needs; no logits for the whole prompt). Other models prefill through the whole model.
BACKBONE_PREFILL = frozenset(a.mlx_model for a in MLX_ARCHS.values())


@dataclass(eq=False)
class _Seq(Sequence):
    """One request: its adapter's load id (0: the base)."""

    gid: int = 0


@dataclass
class _Loaded:
    gid: int
    paths: list[str]
    nbytes: int


class MlxEngine(AdapterEngine):
    """The base model in ``model_dir`` (an MLX LM directory) served with adapters. ``n_ctx``: the most tokens
    (prompt + output) one request may use; ``max_batch``: rows decoded together; ``prefill_step``: prompt
    tokens per forward while prefilling."""

    def __init__(self, model_dir: Path, *, n_ctx: int = 2048, max_batch: int = 32, prefill_step: int = 512
                 ) -> None:
        self.model_dir = Path(model_dir)
        self.n_ctx, self.max_batch, self.prefill_step = n_ctx, max_batch, prefill_step
        self._cv = threading.Condition()
        self._pending: list[_Seq] = []
        self._jobs: list[tuple[Callable[[], object], Future]] = []
        self._closed = False
        self._loaded: dict[str, _Loaded] = {}
        self._loads = itertools.count(1)
        self.base_bytes = self.stack_bytes = 0
        self.max_batch_seqs = 0  # the most rows decoded together so far (observability, tests)
        self.max_batch_adapters = 0  # the most distinct adapters (base included) in one step
        ready: Future = Future()
        self._thread = threading.Thread(target=self._worker, args=(ready,), daemon=True, name="mlx-engine")
        self._thread.start()
        ready.result()

    # -- the worker thread ------------------------------------------------------------------------------
    def _load_model(self) -> None:
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load

        from .mlx_lora import Rows, targets

        try:
            self.model, self.tokenizer = load(str(self.model_dir))
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise UserError(f"mlx-lm cannot load {self.model_dir}: {e}",
                            "pass an MLX LM directory (tuneport export --target mlx) or an HF model directory"
                            ) from e
        caches = make_prompt_cache(self.model)
        if not all(hasattr(c, "merge") for c in caches):
            kinds = sorted({type(c).__name__ for c in caches if not hasattr(c, "merge")})
            raise UserError(f"{self.model_dir}: mlx-lm cannot batch this model's caches ({', '.join(kinds)})",
                            "serve it with mlx_lm.server (one request at a time) or another engine")
        inner = getattr(self.model, "language_model", None)  # a wrapper's (Qwen3.5's) text model holds the vocabulary
        self.n_vocab = int((inner if hasattr(inner, "args") else self.model).args.vocab_size)
        self.base_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.targets = targets(self.model)
        self.eos = set(self.tokenizer.eos_token_ids or ())
        self.rows = Rows()
        kind = type(self.model).__module__.rsplit(".", 1)[-1]
        self.prefill = self.model.model if kind in BACKBONE_PREFILL else self.model

    def _worker(self, ready: Future) -> None:
        try:
            self._load_model()
        except BaseException as e:  # noqa: BLE001 - the constructor raises it
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every waiting request gets it
            log.exception("the MLX engine stopped")
            with self._cv:
                self._closed = True
                for s in self._pending:
                    s.out.put(e if isinstance(e, Exception) else RuntimeError(str(e)))
                self._pending.clear()
                for _, fut in self._jobs:
                    fut.set_exception(RuntimeError("the MLX engine stopped"))
                self._jobs.clear()
        finally:
            self.model = self.prefill = None
            import mlx.core as mx

            mx.clear_cache()

    def _loop(self) -> None:
        active: list[_Seq] = []
        cache: list | None = None
        try:
            while True:
                with self._cv:
                    while not (self._pending or self._jobs or active or self._closed):
                        self._cv.wait()
                    if self._closed:
                        return
                    jobs, self._jobs = self._jobs, []
                    room = self.max_batch - len(active)
                    admit, self._pending = self._pending[:room], self._pending[room:]
                try:
                    active, cache = self._keep(active, cache, [s for s in active if not s.cancelled])
                    for fn, fut in jobs:  # adapters change between steps, never during one
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # noqa: BLE001 - the caller raises it
                            fut.set_exception(e)
                    if jobs:  # a row whose adapter is gone gets the error (the pool's references prevent it)
                        active, cache = self._keep(active, cache, [s for s in active if self._adapter_live(s)])
                except BaseException:  # the engine stops: what was taken off the queues is answered too
                    for s in admit:
                        s.out.put(RuntimeError("the MLX engine stopped"))
                    for _, fut in jobs:
                        if not fut.done():
                            fut.set_exception(RuntimeError("the MLX engine stopped"))
                    raise
                try:
                    active, cache = self._admit(active, cache, admit)
                    if active:
                        active, cache = self._step(active, cache)
                except Exception as e:  # noqa: BLE001 - the batch fails, the engine goes on
                    log.exception("MLX batch step failed")
                    for s in active + admit:
                        s.out.put(e)
                    active, cache = [], None
        finally:
            for s in active:
                s.out.put(RuntimeError("engine closed"))

    def _adapter_live(self, s: _Seq) -> bool:
        """Whether the adapter ``s`` was admitted with is still loaded (else ``s`` gets the error)."""
        if s.gid == 0 or any(v.gid == s.gid for v in self._loaded.values()):
            return True
        s.out.put(UserError("the request's adapter was unloaded meanwhile", "retry the request"))
        return False

    @staticmethod
    def _keep(active: list[_Seq], cache: list | None, keep: list[_Seq]) -> tuple[list[_Seq], list | None]:
        """The batch reduced to ``keep`` (a subsequence of ``active``)."""
        if len(keep) == len(active):
            return active, cache
        if not keep:
            return [], None
        index = {id(s): i for i, s in enumerate(active)}
        rows = [index[id(s)] for s in keep]
        for c in cache:
            c.filter(rows)
        return keep, cache

    def _admit(self, active: list[_Seq], cache: list | None, new: list[_Seq]) -> tuple[list[_Seq], list | None]:
        """Prefill each new request alone (all of its prompt but the last token) and merge it into the batch."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        caches, joined = [], []
        for s in new:
            if s.cancelled:
                s.out.put(Done(s.index))
                continue
            if s.gid and not self._adapter_live(s):
                continue
            try:
                c = make_prompt_cache(self.model)
                self.rows.set([s.gid])
                prompt = s.req.prompt_tokens[:-1]
                for i in range(0, len(prompt), self.prefill_step):
                    self.prefill(mx.array([prompt[i: i + self.prefill_step]]), cache=c)
                    mx.eval([x.state for x in c])
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                s.out.put(e)
                continue
            s.last = s.req.prompt_tokens[-1]
            caches.append(c)
            joined.append(s)
        if not joined:
            return active, cache
        merged = [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]
        if cache is None:
            return joined, merged
        for mine, theirs in zip(cache, merged, strict=True):
            mine.extend(theirs)
        return active + joined, cache

    def _step(self, active: list[_Seq], cache: list) -> tuple[list[_Seq], list | None]:
        """One token for every row, whatever its adapter, in one forward."""
        import mlx.core as mx

        self.rows.set([s.gid for s in active])
        self.max_batch_seqs = max(self.max_batch_seqs, len(active))
        self.max_batch_adapters = max(self.max_batch_adapters, len({s.gid for s in active}))
        logits = self.model(mx.array([[s.last] for s in active]), cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # as mlx-lm samples
        greedy = mx.argmax(logprobs, axis=-1)
        sampled = [i for i, s in enumerate(active) if s.req.temperature > 0]
        scoring = sampled or any(s.req.logprobs is not None for s in active)
        mx.eval(greedy, logprobs) if scoring else mx.eval(greedy)
        tokens = greedy.tolist()
        for i in sampled:
            tokens[i] = sample(np.array(logprobs[i].astype(mx.float32)), active[i].req, active[i].rng)
        scored = [np.array(logprobs[i].astype(mx.float32)) if s.req.logprobs is not None else None
                  for i, s in enumerate(active)]
        keep = [s for s, tok, row in zip(active, tokens, scored, strict=True) if not s.emit(tok, tok in self.eos, row)]
        return self._keep(active, cache, keep)

    def _call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the worker thread between two steps; its result (or exception) here."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("engine closed")
            self._jobs.append((fn, fut))
            self._cv.notify_all()
        return fut.result()

    # -- adapters ------------------------------------------------------------------------------------
    def load_adapter(self, name: str, weights: dict) -> int:
        """Place ``weights`` ({module path: ModuleLora}) as ``name``; the bytes of its tensors (fp32)."""
        from .mlx_lora import misfits

        if not weights:
            raise UserError(f"adapter {name} holds no LoRA matrices", "pass a LoRA or DoRA adapter")
        problems = misfits(self.targets, weights)
        if problems:
            more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
            raise UserError(f"adapter {name} does not fit this base: {'; '.join(problems[:4])}{more}",
                            "it was trained for another model: serve it with its own base")
        return int(self._call(lambda: self._place(name, weights)))

    def _place(self, name: str, weights: dict) -> int:
        from .mlx_lora import place, stack_bytes

        if name in self._loaded:
            raise UserError(f"adapter {name!r} is already loaded", "unload it first")
        gid = next(self._loads)
        place(self.model, self.rows, gid, weights)
        nbytes = sum(w.nbytes for w in weights.values())
        self._loaded[name] = _Loaded(gid, list(weights), nbytes)
        self.stack_bytes = stack_bytes(self.model)
        return nbytes

    def unload_adapter(self, name: str) -> None:
        self._call(lambda: self._remove(name))

    def _remove(self, name: str) -> None:
        from .mlx_lora import remove, stack_bytes

        loaded = self._loaded.pop(name, None)
        if loaded is None:
            raise UserError(f"adapter {name!r} is not loaded", "")
        remove(self.model, loaded.gid, loaded.paths)
        self.stack_bytes = stack_bytes(self.model)

    # -- requests ------------------------------------------------------------------------------------
    def events(self, request: GenerationRequest) -> Iterator[Event]:
        """The events of ``request``: one choice, log-probabilities of generated tokens when asked."""
        if request.n != 1 or request.prompt_logprobs or request.grammar:
            raise UserError("the MLX engine answers one choice, without prompt scores or grammars",
                            "serve with --engine llamacpp or vllm for n, echo and response_format")
        prompt = list(request.prompt_tokens)
        if not prompt or len(prompt) + request.max_tokens > self.n_ctx:
            raise UserError(f"prompt of {len(prompt)} tokens + max_tokens {request.max_tokens} does not fit the "
                            f"context of {self.n_ctx}", "shorten the prompt or lower max_tokens")
        if len(request.adapters) > 1 or any(s != 1.0 for s in request.adapters.values()):
            raise UserError("the MLX engine runs one adapter per request at its own scale",
                            "pick one adapter with model=NAME")
        if request.max_tokens <= 0:
            return EventStream([])
        with self._cv:
            missing = [n for n in request.adapters if n not in self._loaded]
            if missing:
                raise UserError(f"adapter(s) {missing} not loaded", "load them first")
            if self._closed:
                raise RuntimeError("engine closed")
            seq = _Seq(request, gid=next((self._loaded[n].gid for n in request.adapters), 0))
            self._pending.append(seq)
            self._cv.notify_all()
        return seq.events()

    # -- state ---------------------------------------------------------------------------------------
    @staticmethod
    def active_bytes() -> int:
        """Bytes of every live MLX array in this process (the base, the adapter stacks, running KV caches)."""
        import mlx.core as mx

        return int(mx.get_active_memory())

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for s in self._pending:
                s.out.put(RuntimeError("engine closed"))
            self._pending.clear()
            for _, fut in self._jobs:
                fut.set_exception(RuntimeError("engine closed"))
            self._jobs.clear()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
