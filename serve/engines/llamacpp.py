"""llama.cpp through llama-cpp-python's low-level API: one model, GGUF LoRAs attached per request,
worker contexts over the same model.

A context's adapter set is replaced (``llama_set_adapters_lora``) and its KV cache cleared before every
request, so a cache is never reused across adapter sets. Adapters are validated against the model
(architecture, tensor names, shapes) before llama.cpp sees them: a bad file would give a NULL adapter,
and a NULL adapter segfaults at decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.read import check_gguf_lora, gguf_field, open_gguf, tensor_shapes
from tuneport.convert.gguf.runtime import llamacpp_logging

from .base import Done, Event, EventStream, GenerationRequest, PromptScores, Sequence, sample, token_logprobs, tokens_of
from .utf8 import Utf8Table

__all__ = ["GenerationRequest", "LlamaCppEngine"]


@dataclass(eq=False)
class _Seq(Sequence):
    """One choice inside a worker's batch: its adapter set, sequence id, position, and grammar sampler."""

    key: tuple = ()
    seq_id: int = -1
    pos: int = 0
    grammar: object = None  # a llama_sampler constraining the output, when the request has a grammar
    utf8_pending: int = 0  # continuation bytes the constrained output still needs for a whole character


# llama.cpp's llama_token_data, for a whole row of logits filled at once
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LlamaCppEngine:
    def __init__(self, model_path: Path, *, n_ctx: int = 2048, n_workers: int = 2, n_threads: int | None = None,
                 kv_f32: bool = False, n_seq_max: int = 8) -> None:
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
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(self.model_path).encode(), mp)
        if not self.model:
            self._logging.close()
            raise UserError(f"llama.cpp could not load {self.model_path}",
                            "check the file with tuneport inspect; --log-level debug shows llama.cpp's reason")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_workers = n_workers
        self._adapters: dict[str, object] = {}
        self._lock = threading.Lock()
        # Each load of a name gets a new generation: an adapter set is (name, scale, generation), so a context
        # decoding with one load of a name never admits a request made against a later reload of it.
        self._loads = itertools.count(1)
        self._generation: dict[str, int] = {}
        self._cv = threading.Condition()
        self._pending: list[list[_Seq]] = []  # requests waiting, each as its choices
        self._attached: dict[int, tuple] = {}  # worker context -> the adapter set attached to it
        self._closed = False
        self.max_batch_seqs = 0  # the most sequences decoded together so far (observability, tests)
        self._contexts = []
        for _ in range(n_workers):
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx = cp.n_batch = n_ctx * n_seq_max  # one shared (unified) cache, n_ctx per sequence
            cp.n_ubatch = min(cp.n_ctx, 512)
            cp.n_seq_max = n_seq_max
            cp.kv_unified = True
            # llama.cpp's default is 4 threads per context: on a small machine that oversubscribes the cores
            cp.n_threads = cp.n_threads_batch = n_threads or max(1, os.cpu_count() or 1)
            cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if kv_f32:
                cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F32
            ctx = llama_cpp.llama_init_from_model(self.model, cp)
            if not ctx:
                self.close()
                raise UserError(f"llama.cpp could not create a context of {n_ctx * n_seq_max} cells",
                                "lower --n-ctx or --workers; --log-level debug shows llama.cpp's reason")
            self._contexts.append(ctx)
        self._workers = [threading.Thread(target=self._worker, args=(ctx,), daemon=True, name=f"llamacpp-{i}")
                         for i, ctx in enumerate(self._contexts)]
        for t in self._workers:
            t.start()

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
        """Free ``name`` once no context decodes with it: a request that was just cancelled may still be in
        its last step, and freeing an adapter attached to a context would crash llama.cpp."""
        with self._cv:
            while any(n == name for key in self._attached.values() for n, _, _ in key):
                self._cv.wait()
            with self._lock:
                ptr = self._adapters.pop(name)
                self._generation.pop(name, None)
        self.lc.llama_adapter_lora_free(ptr)

    # -- generation: continuous batching per adapter set ------------------------------------------
    def generate(self, request: GenerationRequest) -> Iterator[int]:
        """Tokens of the first choice one at a time for ``request`` (prompt already tokenized)."""
        return tokens_of(self.events(request))

    def events(self, request: GenerationRequest) -> Iterator[Event]:
        """The events of ``request`` (prompt already tokenized). Requests with the same adapter set are decoded
        together in one context; a context only switches sets when it has drained. The ``n`` choices share
        the prompt's KV cells (decoded once, then copied by reference)."""
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
            if self._closed:
                for sq in group:
                    self._free_grammar(sq)
                raise RuntimeError("engine closed")
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

    def _set_adapters(self, ctx, key: tuple) -> None:
        """Attach the adapter set ``key`` ((name, scale, generation), ...) to ``ctx``."""
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
            lc.llama_set_adapters_lora(ctx, arr, n, scales)
        else:
            lc.llama_set_adapters_lora(ctx, None, 0, None)

    def _claim(self, key: tuple | None, slots: int) -> list[_Seq]:
        """Whole pending requests (all their choices) for ``key`` (or, if None, the oldest request's key) that
        fit ``slots`` sequences; lock held."""
        if not self._pending or slots <= 0:
            return []
        if key is None:
            key = self._pending[0][0].key
        elif any(g[0].key != key for g in self._pending):
            return []  # another adapter set is waiting: drain this one so the context can switch
        taken: list[_Seq] = []
        for group in [g for g in self._pending if g[0].key == key]:
            if len(taken) + len(group) > slots:
                break
            self._pending.remove(group)
            taken += group
        return taken

    def _worker(self, ctx) -> None:
        lc = self.lc
        mem = lc.llama_get_memory(ctx)
        batch = lc.llama_batch_init(self.n_ctx * self.n_seq_max, 0, self.n_seq_max)
        try:
            while True:
                with self._cv:
                    while not self._pending and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    active = self._claim(None, self.n_seq_max)
                    key = active[0].key
                    self._attached[id(ctx)] = key  # before the pointers are read: unload waits for it
                lc.llama_memory_clear(mem, True)  # never reuse a cache across adapter sets
                try:
                    self._set_adapters(ctx, key)
                    self._run(ctx, mem, batch, active, key)
                except BaseException as e:  # noqa: BLE001 - delivered to the waiting requests
                    for sq in active:
                        sq.out.put(e if isinstance(e, Exception) else RuntimeError(str(e)))
                        self._free_grammar(sq)
                finally:
                    lc.llama_set_adapters_lora(ctx, None, 0, None)  # no context keeps a pointer to an adapter
                    with self._cv:
                        del self._attached[id(ctx)]
                        self._cv.notify_all()
        finally:
            lc.llama_batch_free(batch)

    def _run(self, ctx, mem, batch, active: list[_Seq], key: tuple) -> None:
        lc = self.lc
        free_ids = list(range(self.n_seq_max))
        for sq in active:
            sq.seq_id = free_ids.pop(0)
        while active:
            if self._closed:
                raise RuntimeError("engine closed")  # the worker hands it to every active request
            n = 0
            rows: list[tuple[_Seq, int]] = []
            prefilled: dict[int, tuple[_Seq, int]] = {}  # id(group) -> (first choice, its first prompt row)
            for sq in active:
                if sq.pos == 0 and sq.index > 0:  # another choice of a request prefilled in this batch
                    rows.append((sq, rows[-1][1]))
                    continue
                feed = sq.req.prompt_tokens if sq.pos == 0 else [sq.last]
                every = sq.pos == 0 and sq.req.prompt_logprobs  # echo scores every prompt token
                if sq.pos == 0:
                    prefilled[id(sq.group)] = (sq, n)
                for j, tok in enumerate(feed):
                    batch.token[n] = tok
                    batch.pos[n] = sq.pos + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = sq.seq_id
                    batch.logits[n] = every or j == len(feed) - 1
                    n += 1
                rows.append((sq, n - 1))
                sq.pos += len(feed)
            batch.n_tokens = n
            self.max_batch_seqs = max(self.max_batch_seqs, len(rows))
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for first, start in prefilled.values():
                for sq in first.group[1:]:  # the other choices share the prompt's cells
                    lc.llama_memory_seq_cp(mem, first.seq_id, sq.seq_id, -1, -1)
                    sq.pos = first.pos
                if first.req.prompt_logprobs:
                    first.out.put(self._prompt_scores(ctx, first.req, start))
            still = []
            for sq, row in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                if sq.req.max_tokens <= 0:  # scored, nothing to generate
                    sq.out.put(Done(sq.index))
                    done = True
                else:
                    allowed = self._constrain(sq, logits) if sq.grammar is not None else logits
                    if sq.grammar is not None and not np.isfinite(allowed).any():
                        sq.out.put(Done(sq.index))  # the grammar admits nothing more
                        done = True
                    else:
                        tok = sample(allowed, sq.req, sq.rng)
                        eog = lc.llama_vocab_is_eog(self.vocab, tok)
                        if sq.grammar is not None and not eog:
                            lc.llama_sampler_accept(sq.grammar, tok)
                            sq.utf8_pending = self._utf8.after(sq.utf8_pending, tok)
                        done = sq.emit(tok, eog, logits)
                if done:
                    lc.llama_memory_seq_rm(mem, sq.seq_id, -1, -1)
                    free_ids.append(sq.seq_id)
                    self._free_grammar(sq)
                else:
                    still.append(sq)
            active[:] = still  # the worker sees who is active if a step fails
            with self._cv:  # continuous batching: same adapter set joins at the next step
                for sq in self._claim(key, len(free_ids)):
                    sq.seq_id = free_ids.pop(0)
                    active.append(sq)

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
        for t in getattr(self, "_workers", []):
            t.join(timeout=30)
        for ctx in self._contexts:
            self.lc.llama_free(ctx)
        self._contexts = []
        with self._lock:
            for ptr in self._adapters.values():
                self.lc.llama_adapter_lora_free(ptr)
            self._adapters.clear()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None
        self._logging.close()
