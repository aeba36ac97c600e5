"""llama.cpp through llama-cpp-python's low-level API: one model, GGUF LoRAs attached per request, one decode
loop over up to ``n_contexts`` contexts.

Attaching another adapter set to a context makes llama.cpp plan its compute graph again (about half a
one-token decode), so the loop keeps adapter sets on contexts of their own: a request joins the context
already decoding its adapter set, else an idle one, else a new context (created when first needed, up to
``n_contexts``), else the context with the fewest adapter sets. Within a context, sequences of different adapter
sets live in one KV cache together: each sequence's cells were computed under its own adapter set, so they stay
valid, and the context decodes one adapter set at a time (``llama_set_adapters_lora``, decode that group, next
set), round-robin, so no adapter set waits for another to drain and no cache is cleared to switch. Each turn of
the loop decodes once in every busy context; new requests join at the next turn. Finished sequences' cells are
kept as a prompt cache (:mod:`.prompt_cache`) per context, reused only under the identical adapter set.
Adapters are validated against the model (architecture, tensor names, shapes) before llama.cpp sees them: a
bad file would give a NULL adapter, and a NULL adapter segfaults at decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.read import check_gguf_lora, gguf_field, open_gguf, tensor_shapes
from tuneport.convert.gguf.runtime import llamacpp_errors, llamacpp_logging, llamacpp_reason

from .base import Done, Event, EventStream, GenerationRequest, PromptScores, Sequence, sample, token_logprobs, tokens_of
from .prompt_cache import PromptCache
from .utf8 import Utf8Table

__all__ = ["GenerationRequest", "LlamaCppEngine", "physical_cores"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Seq(Sequence):
    """One choice inside the decode loop: its adapter set, sequence id, position, and grammar sampler."""

    key: tuple = ()
    seq_id: int = -1
    pos: int = 0
    prefilled: bool = False
    fed: list[int] = field(default_factory=list)  # the tokens whose cells this sequence holds
    grammar: object = None  # a llama_sampler constraining the output, when the request has a grammar
    utf8_pending: int = 0  # continuation bytes the constrained output still needs for a whole character


# Decodes in a row for one adapter set before the next set's turn. Attaching another set makes llama.cpp plan
# its compute graph again: ~3.7 ms against a ~6 ms one-token decode of a 125M Q8_0 model on 2 cores (measured),
# so switching at every token would spend a third of the time switching.
QUANTUM = 8

# llama.cpp's llama_token_data, for a whole row of logits filled at once
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def physical_cores() -> int:
    """Cores this process may run on, counting each physical core once (hyper-threads share its units)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return max(1, allowed)
    threads_per_core: dict[tuple[str, str], int] = {}
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "core id" in fields:
            core = (fields.get("physical id", "0"), fields["core id"])
            threads_per_core[core] = threads_per_core.get(core, 0) + 1
    siblings = max(threads_per_core.values(), default=1)
    return max(1, allowed // siblings)


class _Batch:
    """A llama_batch over numpy arrays: filled by slices, not token by token (one sequence id per token, so
    ``seq_id[i]`` points at row i of one int32 column)."""

    def __init__(self, lc, capacity: int) -> None:
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        base = self.seq.ctypes.data
        self.seq_ptrs = (ctypes.POINTER(lc.llama_seq_id) * capacity)(
            *(ctypes.cast(base + 4 * i, ctypes.POINTER(lc.llama_seq_id)) for i in range(capacity)))
        self.struct = lc.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(ctypes.POINTER(lc.llama_token)), embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), seq_id=self.seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))


@dataclass(eq=False)
class _Context:
    """One llama.cpp context and the sequences it decodes: a unified KV cache, ``n_seq_max`` sequence ids for
    requests and ``cache.capacity`` more for the prompt cache."""

    ctx: object
    mem: object
    free: list[int]
    cache: PromptCache
    active: list[_Seq] = field(default_factory=list)
    current: tuple | None = None  # the adapter set attached to the context
    streak: int = 0  # decodes in a row of the attached adapter set
    done_unloads: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)  # unloaded adapters whose cached cells are still to drop


class LlamaCppEngine:
    def __init__(self, model_path: Path, *, n_ctx: int = 2048, n_contexts: int = 1, n_threads: int | None = None,
                 kv_f32: bool = False, n_seq_max: int = 8, prompt_cache: bool = True, cache_entries: int = 8,
                 n_gpu_layers: int = 0) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.model_path = Path(model_path)
        reader = open_gguf(self.model_path)
        self.arch = gguf_field(reader, "general.architecture")
        self.tensor_shapes = tensor_shapes(reader)
        del reader
        # llama.cpp logs while loading and at every adapter switch: to `logging` for the engine's lifetime
        self._logging = contextlib.ExitStack()
        self._logging.enter_context(llamacpp_logging())
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers  # -1: all (see convert.gguf.gpu)
        self.n_gpu_layers = n_gpu_layers
        with llamacpp_errors() as errors:
            self.model = llama_cpp.llama_model_load_from_file(str(self.model_path).encode(), mp)
        if not self.model:
            self._logging.close()
            raise UserError(f"llama.cpp could not load {self.model_path}: {llamacpp_reason(errors)}",
                            "check the file with tuneport inspect; --log-level debug shows llama.cpp's whole log")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_swa = llama_cpp.llama_model_n_swa(self.model)  # a sliding window: its cache forgets old cells
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max  # sequences one context decodes together
        self.n_contexts = n_contexts  # the most contexts the loop creates (each n_ctx × n_seq_max KV cells)
        self.kv_f32 = kv_f32
        self.prompt_cache = prompt_cache
        self.cache_entries = cache_entries if prompt_cache else 0
        # one loop decodes one context at a time, so each decode has every physical core
        self.n_threads = n_threads or physical_cores()
        self._adapters: dict[str, object] = {}
        self._lock = threading.Lock()
        # Each load of a name gets a new generation: an adapter set is (name, scale, generation), so a context
        # never admits a request made against an earlier load of a name, and cached cells never outlive a load.
        self._loads = itertools.count(1)
        self._generation: dict[str, int] = {}
        self._cv = threading.Condition()
        self._pending: list[list[_Seq]] = []  # requests waiting, each as its choices
        self._unloading: set[str] = set()  # names each context must stop using (and drop from its cache)
        self._closed = False
        self.max_batch_seqs = 0  # the most sequences decoded in one step so far (observability, tests)
        self.max_live_adapter_sets = 0  # the most adapter sets decoding at once (none drained first)
        self.max_live_contexts = 0  # the most contexts decoding in one turn of the loop
        self._batch = _Batch(llama_cpp, n_ctx * n_seq_max)  # the loop fills one batch at a time
        self._contexts: list[_Context] = []
        try:
            self._contexts.append(self._new_context())  # the others when mixed traffic needs them
        except UserError:
            self.close()
            raise
        self._worker = threading.Thread(target=self._run, daemon=True, name="llamacpp-loop")
        self._worker.start()

    def _new_context(self) -> _Context:
        ctx = self._llama_context(self.kv_f32)
        return _Context(ctx, self.lc.llama_get_memory(ctx), list(range(self.n_seq_max + self.cache_entries)),
                        PromptCache(self.cache_entries))

    def _llama_context(self, kv_f32: bool):
        lc = self.lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = cp.n_batch = self.n_ctx * self.n_seq_max  # one shared (unified) cache, n_ctx per sequence
        cp.n_ubatch = min(cp.n_ctx, 512)
        cp.n_seq_max = self.n_seq_max + self.cache_entries
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = self.n_threads  # llama.cpp's default (4) oversubscribes small machines
        # flash attention: 1.5x the tokens/s of the plain path on CPU (measured, docs/benchmarks.md); off with an
        # F32 cache, whose point is transformers' fp32 numbers
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED if kv_f32 else lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if kv_f32:
            cp.type_k = cp.type_v = lc.GGML_TYPE_F32
        ctx = lc.llama_init_from_model(self.model, cp)
        if not ctx:
            raise UserError(f"llama.cpp could not create a context of {cp.n_ctx} cells",
                            "lower --n-ctx; --log-level debug shows llama.cpp's reason")
        return ctx

    # -- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> int:
        nbytes = check_gguf_lora(Path(path), self.arch, self.tensor_shapes)
        ptr = self.lc.llama_adapter_lora_init(self.model, str(path).encode())
        if not ptr:  # NULL pointer: falsy, not None
            raise UserError(f"llama.cpp refused adapter {name} ({path.name})", "re-export the adapter for this base")
        with self._lock:
            self._adapters[name] = ptr
            self._generation[name] = next(self._loads)
        return nbytes

    def unload_adapter(self, name: str) -> None:
        """Free ``name`` once every context has stopped using it: its running sequences finished, its cached cells
        dropped, the context detached from it (freeing an adapter a context holds would crash llama.cpp). Contexts
        are only added under the lock, so the ones checked here are all there are."""
        with self._cv:
            if self._closed:
                return  # close() frees every adapter
            if any(self._uses(cx, name) for cx in self._contexts) or any(
                    n == name for g in self._pending for n, _, _ in g[0].key):
                self._unloading.add(name)  # wait for the contexts to stop using it
                self._cv.notify_all()
                while not all(name in cx.done_unloads for cx in self._contexts) and not self._closed:
                    self._cv.wait()
                for cx in self._contexts:
                    cx.done_unloads.discard(name)
                self._unloading.discard(name)
                if self._closed:
                    return
            else:  # nothing decodes with it: free at once, the loop drops its cached cells at its next turn
                for cx in self._contexts:
                    cx.stale.add(name)
                self._cv.notify_all()
            with self._lock:
                ptr = self._adapters.pop(name)
                self._generation.pop(name, None)
        self.lc.llama_adapter_lora_free(ptr)

    @staticmethod
    def _uses(cx: _Context, name: str) -> bool:
        """Whether ``cx`` decodes with adapter ``name`` or has it attached (read by another thread: a stale
        answer errs on the side of waiting, and a request admitted meanwhile fails its generation check)."""
        return any(n == name for sq in list(cx.active) for n, _, _ in sq.key) or any(
            n == name for n, _, _ in (cx.current or ()))

    @property
    def cache_stats(self) -> dict[str, int]:
        """Prompt-cache counters summed over the contexts."""
        cxs = list(self._contexts)
        return {"prompt_cache_hits_total": sum(cx.cache.stats.hits for cx in cxs),
                "prompt_cache_hit_tokens_total": sum(cx.cache.stats.hit_tokens for cx in cxs),
                "prompt_cache_misses_total": sum(cx.cache.stats.misses for cx in cxs),
                "prompt_cache_entries": sum(len(cx.cache) for cx in cxs),
                "llamacpp_contexts": len(cxs)}  # created so far (lazily, up to --contexts)

    # -- requests -------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> Iterator[int]:
        """Tokens of the first choice one at a time for ``request`` (prompt already tokenized)."""
        return tokens_of(self.events(request))

    def events(self, request: GenerationRequest) -> Iterator[Event]:
        """The events of ``request`` (prompt already tokenized), submitted at once. The ``n`` choices share the
        prompt's KV cells (decoded once, then copied by reference)."""
        prompt = list(request.prompt_tokens)
        if not prompt or len(prompt) + request.max_tokens > self.n_ctx:
            raise UserError(f"prompt of {len(prompt)} tokens + max_tokens {request.max_tokens} does not fit the "
                            f"context of {self.n_ctx}", "shorten the prompt or lower max_tokens")
        if not 1 <= request.n <= self.n_seq_max:
            raise UserError(f"n={request.n}: a context decodes 1 to {self.n_seq_max} sequences together",
                            f"ask for at most {self.n_seq_max} choices")
        with self._lock:
            missing = [n for n in request.adapters if n not in self._adapters]
            key = tuple(sorted((n, float(s), self._generation.get(n, 0)) for n, s in request.adapters.items()))
        if missing:
            raise UserError(f"adapter(s) {missing} not loaded", "load them first")
        if request.max_tokens <= 0 and not request.prompt_logprobs:
            return EventStream([])
        group = _Seq.choices(request, key=key)
        if request.grammar:
            for sq in group:
                sq.grammar = self._grammar(request.grammar, group)
        with self._cv:
            if self._closed or any(n in self._unloading for n in request.adapters):
                for sq in group:
                    self._free_grammar(sq)
                if self._closed:
                    raise RuntimeError("engine closed")
                raise UserError("the request's adapter is being unloaded", "retry the request")
            self._pending.append(group)
            self._cv.notify_all()
        return group[0].events()

    def _grammar(self, gbnf: str, group: list[_Seq]):
        """A grammar sampler for ``gbnf`` (rule ``root``); a grammar llama.cpp cannot parse is the client's error."""
        smpl = self.lc.llama_sampler_init_grammar(self.vocab, gbnf.encode(), b"root")
        if not smpl:
            for sq in group:
                self._free_grammar(sq)
            raise UserError("llama.cpp could not parse the grammar", "check the schema (--log-level debug shows why)")
        return smpl

    def _free_grammar(self, sq: _Seq) -> None:
        if sq.grammar is not None:
            self.lc.llama_sampler_free(sq.grammar)
            sq.grammar = None

    # -- the decode loop --------------------------------------------------------------------------
    def _run(self) -> None:
        """The decode loop: place new requests, then one decode in every context with active sequences."""
        while True:
            with self._cv:
                while not (self._closed or self._pending or any(
                        cx.active or cx.stale or self._unloading - cx.done_unloads for cx in self._contexts)):
                    self._cv.wait()
                if self._closed:
                    for cx in self._contexts:
                        self._fail(cx, RuntimeError("engine closed"))
                    return
                for cx in self._contexts:
                    if self._unloading - cx.done_unloads:
                        self._release_unloaded(cx)
                        self._cv.notify_all()
                    for name in cx.stale:
                        self._drop_cached(cx, name)
                    cx.stale.clear()
                placed, grow = self._claim()
            if grow:
                self._grow()
            for cx in list(self._contexts):
                try:
                    self._admit(cx, placed.get(id(cx), []))
                except Exception as e:  # noqa: BLE001 - delivered to the requests this context holds
                    self._fail(cx, e)
            busy = [cx for cx in self._contexts if cx.active]
            self.max_live_contexts = max(self.max_live_contexts, len(busy))
            self.max_live_adapter_sets = max(self.max_live_adapter_sets,
                                             len({sq.key for cx in busy for sq in cx.active}))
            for cx in busy:
                try:
                    self._step(cx)
                except Exception as e:  # noqa: BLE001 - delivered to the requests this context holds
                    self._fail(cx, e)

    def _claim(self) -> tuple[dict[int, list[list[_Seq]]], bool]:
        """Whole pending requests, oldest first, each placed on a context with room (cache entries give their
        sequence ids back when needed), until one finds none; and whether that one wants a new context. Lock
        held."""
        room = {id(cx): min(len(cx.free) + len(cx.cache), self.n_seq_max - len(cx.active)) for cx in self._contexts}
        keys = {id(cx): {sq.key for sq in cx.active} for cx in self._contexts}
        placed: dict[int, list[list[_Seq]]] = {}
        while self._pending:
            group = self._pending[0]
            if any(n in self._unloading for n, _, _ in group[0].key):
                self._pending.pop(0)
                group[0].out.put(UserError("the request's adapter is being unloaded", "retry the request"))
                for sq in group:
                    self._free_grammar(sq)
                continue
            cx = self._place(group[0].key, len(group), room, keys)
            if cx is None:
                return placed, len(self._contexts) < self.n_contexts
            self._pending.pop(0)
            placed.setdefault(id(cx), []).append(group)
            room[id(cx)] -= len(group)
            keys[id(cx)].add(group[0].key)
        return placed, False

    def _place(self, key: tuple, size: int, room: dict[int, int], keys: dict[int, set]) -> _Context | None:
        """The context for a request of adapter set ``key``: the one decoding that set, else an idle one (the
        one last attached to it first: its cache has the set's prompts), else None while another context may
        still be created (every context is full or busy with other sets), else the one with the fewest adapter
        sets. None when none has room."""
        fits = [cx for cx in self._contexts if room[id(cx)] >= size]
        same = [cx for cx in fits if key in keys[id(cx)]]
        if same:
            return same[0]
        idle = [cx for cx in fits if not keys[id(cx)]]
        if idle:
            return next((cx for cx in idle if cx.current == key), idle[0])
        if len(self._contexts) < self.n_contexts or not fits:
            return None
        return min(fits, key=lambda cx: len(keys[id(cx)]))

    def _grow(self) -> None:
        """One more context for the loop; when llama.cpp cannot make it (memory), the loop keeps those it has."""
        try:
            cx = self._new_context()
        except Exception as e:  # noqa: BLE001 - memory or llama.cpp: the loop goes on with the contexts it has
            log.warning("llama.cpp: no context beyond %d (%s): adapter sets share them", len(self._contexts), e)
            self.n_contexts = len(self._contexts)
            return
        with self._cv:
            self._contexts.append(cx)

    def _admit(self, cx: _Context, groups: list[list[_Seq]]) -> None:
        """Sequence ids for new requests, and the longest cached prefix under the same adapter set."""
        lc = self.lc
        for group in groups:
            cx.active += group  # from here a failure reaches them
        for group in groups:
            first = group[0]
            hit = None
            if cx.cache.capacity and first.req.cache_prompt and not first.req.prompt_logprobs:
                hit = cx.cache.lookup(first.key, first.req.prompt_tokens)
            while len(cx.free) < len(group):  # never the entry just found
                self._forget(cx, cx.cache.evict(keep=hit[0].seq_id if hit else None))
            for sq in group:
                sq.seq_id = cx.free.pop()
            if hit:
                entry, n = hit
                lc.llama_memory_seq_cp(cx.mem, entry.seq_id, first.seq_id, 0, n)
                if self.n_swa and lc.llama_memory_seq_pos_min(cx.mem, first.seq_id) > max(0, n - self.n_swa):
                    # a sliding-window cache overwrote cells this prefix still needs: start afresh
                    lc.llama_memory_seq_rm(cx.mem, first.seq_id, -1, -1)
                    cx.cache.stats.hits -= 1
                    cx.cache.stats.hit_tokens -= n
                    cx.cache.stats.misses += 1
                else:
                    first.pos, first.fed = n, list(first.req.prompt_tokens[:n])

    def _step(self, cx: _Context) -> None:
        """Decode one adapter set's sequences: the attached set again until it has had ``QUANTUM`` decodes in a
        row, then the next set with active sequences, round-robin (attaching a set costs about half a decode)."""
        keys = list(dict.fromkeys(sq.key for sq in cx.active))
        if not keys:
            return
        if cx.current in keys and cx.streak < QUANTUM:
            key = cx.current
        else:
            key = keys[(keys.index(cx.current) + 1) % len(keys)] if cx.current in keys else keys[0]
            cx.streak = 0
        cx.streak += 1
        group = [sq for sq in cx.active if sq.key == key]
        self.max_batch_seqs = max(self.max_batch_seqs, len(group))
        try:
            self._attach(cx, key)
            finished = self._decode(cx, group)
            for sq in finished:
                self._finish(cx, sq)
        except Exception as e:  # noqa: BLE001 - this adapter set's requests fail, the others go on
            for sq in group:  # their cells are not what `fed` says: freed, never cached
                sq.out.put(e)
                self._release(cx, sq)
            finished = group
        gone = {id(sq) for sq in finished}
        cx.active = [sq for sq in cx.active if id(sq) not in gone]

    def _attach(self, cx: _Context, key: tuple) -> None:
        """Attach the adapter set ``key`` ((name, scale, generation), ...) to ``cx``."""
        if cx.current == key:
            return
        lc = self.lc
        with self._lock:
            gone = [name for name, _, gen in key if self._generation.get(name) != gen]
            if gone:
                raise UserError(f"adapter(s) {gone} were unloaded or reloaded meanwhile", "retry the request")
            ptrs = [self._adapters[name] for name, _, _ in key]
        n = len(ptrs)
        if n:
            arr = (lc.llama_adapter_lora_p_ctypes * n)(*ptrs)
            scales = (ctypes.c_float * n)(*(scale for _, scale, _ in key))
            lc.llama_set_adapters_lora(cx.ctx, arr, n, scales)
        else:
            lc.llama_set_adapters_lora(cx.ctx, None, 0, None)
        cx.current = key

    def _decode(self, cx: _Context, group: list[_Seq]) -> list[_Seq]:
        """Feed each sequence of one adapter set (its prompt's remainder, or its last token), decode, sample;
        the sequences that finished."""
        lc, b = self.lc, self._batch
        n = 0
        rows: list[tuple[_Seq, int]] = []
        prefilled: list[tuple[_Seq, int]] = []  # (first choice, its first prompt row) of prompts fed this step
        abandoned: list[_Seq] = []  # cancelled before their prefill: never decoded
        for sq in group:
            if not sq.prefilled and all(c.cancelled for c in sq.group):
                abandoned.append(sq)
                continue
            if not sq.prefilled and sq.index > 0:  # another choice of a request prefilled in this batch
                rows.append((sq, rows[-1][1]))
                continue
            feed = sq.req.prompt_tokens[sq.pos:] if not sq.prefilled else [sq.last]
            k = len(feed)
            b.token[n:n + k] = feed
            b.pos[n:n + k] = np.arange(sq.pos, sq.pos + k)
            b.seq[n:n + k] = sq.seq_id
            if not sq.prefilled:
                prefilled.append((sq, n))
                b.logits[n:n + k] = sq.req.prompt_logprobs  # echo scores every prompt token
            else:
                b.logits[n] = 0
            b.logits[n + k - 1] = 1
            n += k
            rows.append((sq, n - 1))
            sq.pos += k
            sq.fed += feed
            sq.prefilled = True
        for sq in abandoned:
            sq.out.put(Done(sq.index))
        if not rows:
            return abandoned
        b.struct.n_tokens = n
        while (ret := lc.llama_decode(cx.ctx, b.struct)) == 1 and len(cx.cache):
            self._forget(cx, cx.cache.evict())  # no room for the batch: give cached cells back
        if ret != 0:
            raise RuntimeError(f"llama_decode failed ({ret})" + (": the KV cache is full" if ret == 1 else ""))
        for first, start in prefilled:
            for sq in first.group[1:]:  # the other choices share the prompt's cells
                lc.llama_memory_seq_cp(cx.mem, first.seq_id, sq.seq_id, -1, -1)
                sq.pos, sq.fed, sq.prefilled = first.pos, list(first.fed), True
            if first.req.prompt_logprobs:
                first.out.put(self._prompt_scores(cx.ctx, first.req, start))
        # the logits of every output row at once: greedy rows are chosen in one argmax
        flagged = np.flatnonzero(b.logits[:n])
        out_row = {int(r): i for i, r in enumerate(flagged)}
        logits = np.ctypeslib.as_array(lc.llama_get_logits(cx.ctx), shape=(len(flagged), self.n_vocab))
        plain = [i for i, (sq, _) in enumerate(rows)
                 if sq.req.temperature <= 0 and sq.grammar is None and sq.req.logprobs is None]
        greedy = dict(zip(plain, logits[[out_row[rows[i][1]] for i in plain]].argmax(axis=1).tolist(),
                          strict=True)) if plain else {}
        finished = list(abandoned)
        for i, (sq, row) in enumerate(rows):
            if sq.req.max_tokens <= 0:  # scored, nothing to generate
                sq.out.put(Done(sq.index))
                finished.append(sq)
                continue
            own = logits[out_row[row]]
            try:
                if i in greedy:
                    tok = greedy[i]
                else:
                    allowed = self._constrain(sq, own) if sq.grammar is not None else own
                    if sq.grammar is not None and not np.isfinite(allowed).any():
                        sq.out.put(Done(sq.index))  # the grammar admits nothing more
                        finished.append(sq)
                        continue
                    tok = sample(allowed, sq.req, sq.rng)
                eog = lc.llama_vocab_is_eog(self.vocab, tok)
                if sq.grammar is not None and not eog:
                    lc.llama_sampler_accept(sq.grammar, tok)
                    sq.utf8_pending = self._utf8.after(sq.utf8_pending, tok)
                if sq.emit(tok, eog, own):
                    finished.append(sq)
            except Exception as e:  # noqa: BLE001 - this request fails, the others of its set go on
                sq.out.put(e)
                finished.append(sq)
        return finished

    def _finish(self, cx: _Context, sq: _Seq) -> None:
        """A sequence is done: its cells become a prompt-cache entry (the first choice, when caching), or free."""
        self._free_grammar(sq)
        if sq.seq_id < 0:
            return
        if cx.cache.capacity and sq.index == 0 and sq.req.cache_prompt and sq.fed:
            for sid in cx.cache.add(sq.key, sq.fed, sq.seq_id):
                self._forget(cx, sid)
        else:
            self._forget(cx, sq.seq_id)
        sq.seq_id = -1

    def _release(self, cx: _Context, sq: _Seq) -> None:
        """Free a sequence without caching it."""
        self._free_grammar(sq)
        if sq.seq_id >= 0:
            self._forget(cx, sq.seq_id)
            sq.seq_id = -1

    def _drop_cached(self, cx: _Context, name: str) -> None:
        """Free the cached cells computed with adapter ``name``."""
        for sid in cx.cache.drop(name):
            self._forget(cx, sid)

    def _forget(self, cx: _Context, seq_id: int) -> None:
        self.lc.llama_memory_seq_rm(cx.mem, seq_id, -1, -1)
        cx.free.append(seq_id)

    def _release_unloaded(self, cx: _Context) -> None:
        """For each adapter being unloaded that no active sequence uses: drop its cached cells and detach it;
        lock held."""
        for name in self._unloading - cx.done_unloads:
            if any(n == name for sq in cx.active for n, _, _ in sq.key):
                continue
            self._drop_cached(cx, name)
            if cx.current and any(n == name for n, _, _ in cx.current):
                self.lc.llama_set_adapters_lora(cx.ctx, None, 0, None)
                cx.current = None
            cx.done_unloads.add(name)

    def _fail(self, cx: _Context, e: Exception) -> None:
        """Hand ``e`` to every request the context holds and free their sequences."""
        for sq in cx.active:
            sq.out.put(e)
            self._release(cx, sq)
        cx.active = []

    def _prompt_scores(self, ctx, req: GenerationRequest, start: int) -> PromptScores:
        """Each prompt token's log-probability after the first, from the rows decoded at ``start``..."""
        k = req.logprobs or 0
        lps, tops = [], []
        for j, tok in enumerate(req.prompt_tokens[1:]):
            row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(ctx, start + j), shape=(self.n_vocab,))
            lp, top = token_logprobs(row, tok, k)
            lps.append(lp)
            tops.append(top)
        return PromptScores(lps, tops if req.logprobs is not None else None)

    def _constrain(self, sq: _Seq, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar does not admit next at -inf (llama.cpp's grammar sampler)."""
        data = np.empty(self.n_vocab, dtype=TOKEN_DATA)
        data["id"] = np.arange(self.n_vocab)
        data["logit"] = logits
        data["p"] = 0.0
        cur = self.lc.llama_token_data_array(data=data.ctypes.data_as(self.lc.llama_token_data_p),
                                             size=self.n_vocab, selected=-1, sorted=False)
        self.lc.llama_sampler_apply(sq.grammar, ctypes.byref(cur))
        return np.where(self._utf8.allowed(sq.utf8_pending), data["logit"], -np.inf)

    @functools.cached_property
    def _utf8(self) -> Utf8Table:
        """The vocabulary's UTF-8 shapes, built at the first constrained request."""
        ends = np.array([bool(self.lc.llama_vocab_is_eog(self.vocab, t)) for t in range(self.n_vocab)])
        return Utf8Table([self.piece(t) for t in range(self.n_vocab)], ends)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        lc = self.lc
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_bos, special)
        if n < 0:
            raise RuntimeError("tokenize buffer too small")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens rendered as empty)."""
        buf = ctypes.create_string_buffer(64)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def piece_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def special_token(self, kind: str) -> int | None:
        fn = {"bos": self.lc.llama_vocab_bos, "eos": self.lc.llama_vocab_eos}[kind]
        tok = fn(self.vocab)
        return tok if tok >= 0 else None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for group in self._pending:
                group[0].out.put(RuntimeError("engine closed"))
                for sq in group:
                    self._free_grammar(sq)
            self._pending.clear()
            self._cv.notify_all()
        if getattr(self, "_worker", None) is not None:
            self._worker.join()  # a worker may be inside a long prefill: its context is freed only after it
        for cx in self._contexts:
            self.lc.llama_free(cx.ctx)
        self._contexts = []
        with self._lock:
            for ptr in self._adapters.values():
                self.lc.llama_adapter_lora_free(ptr)
            self._adapters.clear()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None
        self._logging.close()
