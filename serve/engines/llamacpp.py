"""llama.cpp through llama-cpp-python's low-level API: one model, GGUF LoRAs attached per request, one decode
loop over up to ``n_contexts`` contexts.

With tuneport's llama-cpp-python (``toolkit/llama_cpp_patches``: per-sequence LoRA, :mod:`.llamacpp_seq_lora`) each
sequence is bound to its own adapter set and one decode batch holds sequences of every set, the base included; an
adapter llama.cpp cannot bind per sequence (LoRA on stacked experts) is attached to the context as below.
With a stock llama-cpp-python the loop falls back to attaching one adapter set per decode:

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
import itertools
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.read import check_gguf_lora, gguf_field, open_gguf, tensor_shapes
from tuneport.convert.gguf.runtime import (
    kv_overrides,
    llamacpp_errors,
    llamacpp_logging,
    llamacpp_reason,
    longrope_choice,
)

from .base import Event, EventStream, GenerationRequest, tokens_of
from .llamacpp_decode import DecodeLoop
from .llamacpp_schedule import Scheduler
from .llamacpp_seq_lora import HeapTrim, batching_label, seq_lora
from .llamacpp_state import DEFAULT_MAX_SETS_PER_BATCH, PER_SEQUENCE, _Batch, _Context, _Seq, physical_cores
from .llamacpp_vocab import Vocabulary
from .prompt_cache import PromptCache

__all__ = ["GenerationRequest", "LlamaCppEngine", "physical_cores"]

log = logging.getLogger(__name__)


class LlamaCppEngine(Scheduler, DecodeLoop, Vocabulary):
    """The engine: the model, its contexts and adapters, requests in and events out; the decode loop's scheduling,
    its decode step and the vocabulary are its parts (``llamacpp_schedule``, ``llamacpp_decode``,
    ``llamacpp_vocab``), the data they share ``llamacpp_state``."""

    def __init__(self, model_path: Path, *, n_ctx: int = 2048, n_contexts: int = 1, n_threads: int | None = None,
                 kv_f32: bool = False, n_seq_max: int = 8, prompt_cache: bool = True, cache_entries: int = 8,
                 n_gpu_layers: int = 0, batch_adapter_sets: bool = True, max_sets_per_batch: int | None = None
                 ) -> None:
        import llama_cpp

        self.lc = llama_cpp
        # per-sequence LoRA (tuneport's patched llama.cpp): every adapter set in one decode batch; None: a stock
        # llama.cpp (or batch_adapter_sets off), where a context decodes one attached adapter set at a time
        self.seq_lora = seq_lora(llama_cpp) if batch_adapter_sets else None
        self._trim_heap = HeapTrim()
        self.max_sets_per_batch = max_sets_per_batch or DEFAULT_MAX_SETS_PER_BATCH
        self.model_path = Path(model_path)
        reader = open_gguf(self.model_path)
        self.arch = gguf_field(reader, "general.architecture")
        self.tensor_shapes = tensor_shapes(reader)
        # LongRoPE (Phi-3.5, Phi-4-mini): the short factors for every request that fits the original context
        rope = longrope_choice(reader, n_ctx * n_seq_max, n_ctx)
        self.rope_note = rope.note
        if rope.note:
            log.warning("llama.cpp: %s", rope.note)
        del reader
        # llama.cpp logs while loading and at every adapter switch: to `logging` for the engine's lifetime
        self._logging = contextlib.ExitStack()
        self._logging.enter_context(llamacpp_logging())
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers  # -1: all (see convert.gguf.gpu)
        if rope.override:
            mp.kv_overrides = kv_overrides(llama_cpp, rope.override)  # ctypes keeps the array with mp
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
        # recurrent layers (Qwen3.5's Gated DeltaNet, Mamba) keep one state per sequence, at its last token: llama.cpp
        # cannot cut it back to a prefix another prompt shares, so a cached prompt could not be reused
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(
            self.model))
        if self.recurrent and prompt_cache:
            log.info("llama.cpp: %s has recurrent layers, whose state cannot be cut back to a shared prefix: "
                     "the prompt cache is off", self.model_path.name)
        self.prompt_cache = prompt_cache and not self.recurrent
        self.cache_entries = cache_entries if self.prompt_cache else 0
        # one loop decodes one context at a time, so each decode has every physical core
        self.n_threads = n_threads or physical_cores()
        self._adapters: dict[str, object] = {}
        self._per_sequence: dict[str, bool] = {}  # adapters llama.cpp can bind per sequence (no expert LoRA)
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
        self.max_batch_adapter_sets = 0  # the most adapter sets in one decode batch (per-sequence LoRA)
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
        # the patch stacks 2-D LoRA matrices (linears, token embeddings); expert LoRA stays attached per context
        per_sequence = self.seq_lora is not None and all(
            self.seq_lora.binds(n, s) for n, s in tensor_shapes(open_gguf(Path(path))).items())
        ptr = self.lc.llama_adapter_lora_init(self.model, str(path).encode())
        if not ptr:  # NULL pointer: falsy, not None
            raise UserError(f"llama.cpp refused adapter {name} ({path.name})", "re-export the adapter for this base")
        with self._lock:
            self._adapters[name] = ptr
            self._per_sequence[name] = per_sequence
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
                self._per_sequence.pop(name, None)
                self._generation.pop(name, None)
        self.lc.llama_adapter_lora_free(ptr)

    @staticmethod
    def _uses(cx: _Context, name: str) -> bool:
        """Whether ``cx`` decodes with adapter ``name`` or has it attached (read by another thread: a stale
        answer errs on the side of waiting, and a request admitted meanwhile fails its generation check)."""
        current = () if cx.current == PER_SEQUENCE else cx.current or ()
        return any(n == name for sq in list(cx.active) for n, _, _ in sq.key) or any(
            n == name for n, _, _ in current) or any(n == name for key in list(cx.bound.values()) for n, _, _ in key)

    def group_key(self, key: tuple) -> tuple:
        """The adapter set the loop schedules a request under: ``PER_SEQUENCE`` for every set llama.cpp binds per
        sequence (they decode together), else the set itself (attached to the context for its decodes)."""
        if self.seq_lora is None:
            return key
        with self._lock:
            ok = all(self._per_sequence.get(n, False) for n, _, _ in key)
        return PER_SEQUENCE if ok else key

    @property
    def adapter_batching(self) -> str:
        """How requests for different adapter sets decode: in one batch (per-sequence LoRA), or a set at a time."""
        return batching_label(self.seq_lora)

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
