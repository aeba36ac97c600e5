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

from .base import GenerationRequest, Sequence, sample

__all__ = ["GenerationRequest", "LlamaCppEngine"]


@dataclass(eq=False)
class _Seq(Sequence):
    """One request inside a worker's batch: its adapter set, sequence id and position."""

    key: tuple = ()
    seq_id: int = -1
    pos: int = 0


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
        self._pending: list[_Seq] = []
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
        """Tokens one at a time for ``request`` (prompt already tokenized). Requests with the same adapter
        set are decoded together in one context; a context only switches sets when it has drained."""
        prompt = list(request.prompt_tokens)
        if not prompt or len(prompt) + request.max_tokens > self.n_ctx:
            raise UserError(f"prompt of {len(prompt)} tokens + max_tokens {request.max_tokens} does not fit the "
                            f"context of {self.n_ctx}", "shorten the prompt or lower max_tokens")
        with self._lock:
            missing = [n for n in request.adapters if n not in self._adapters]
            key = tuple(sorted((n, float(s), self._generation.get(n, 0)) for n, s in request.adapters.items()))
        if missing:
            raise UserError(f"adapter(s) {missing} not loaded", "load them first")
        if request.max_tokens <= 0:
            return
        seq = _Seq(request, key=key)
        with self._cv:
            if self._closed:
                raise RuntimeError("engine closed")
            self._pending.append(seq)
            self._cv.notify_all()
        yield from seq.tokens()

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
        """Pending requests for ``key`` (or, if None, the oldest request's key); lock held."""
        if not self._pending or slots <= 0:
            return []
        if key is None:
            key = self._pending[0].key
        elif any(s.key != key for s in self._pending):
            return []  # another adapter set is waiting: drain this one so the context can switch
        taken = [s for s in self._pending if s.key == key][:slots]
        for s in taken:
            self._pending.remove(s)
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
            n = 0
            rows: list[tuple[_Seq, int]] = []
            for sq in active:
                feed = sq.req.prompt_tokens if sq.pos == 0 else [sq.last]
                for j, tok in enumerate(feed):
                    batch.token[n] = tok
                    batch.pos[n] = sq.pos + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = sq.seq_id
                    batch.logits[n] = j == len(feed) - 1
                    n += 1
                rows.append((sq, n - 1))
                sq.pos += len(feed)
            batch.n_tokens = n
            self.max_batch_seqs = max(self.max_batch_seqs, len(rows))
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            still = []
            for sq, row in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                tok = sample(logits, sq.req, sq.rng)
                if sq.emit(tok, lc.llama_vocab_is_eog(self.vocab, tok)):
                    lc.llama_memory_seq_rm(mem, sq.seq_id, -1, -1)
                    free_ids.append(sq.seq_id)
                else:
                    still.append(sq)
            active = still
            with self._cv:  # continuous batching: same adapter set joins at the next step
                for sq in self._claim(key, len(free_ids)):
                    sq.seq_id = free_ids.pop(0)
                    active.append(sq)

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
            for sq in self._pending:
                sq.out.put(RuntimeError("engine closed"))
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
