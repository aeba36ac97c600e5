"""One decode step of a context: attach its adapter set, fill the batch, decode, sample each sequence's next token
(grammar-constrained where asked), finish and release sequences, keep their cells as the prompt cache."""

from __future__ import annotations

import ctypes

import numpy as np

from tuneport.convert.errors import UserError

from .base import Done, GenerationRequest, PromptScores, sample, token_logprobs
from .llamacpp_state import PER_SEQUENCE, QUANTUM, TOKEN_DATA, _Context, _Seq


class DecodeLoop:
    """One decode step of a context (a part of :class:`~.llamacpp.LlamaCppEngine`, which holds the state)."""

    def _step(self, cx: _Context) -> None:
        """Decode one adapter set's sequences: the attached set again until it has had ``QUANTUM`` decodes in a
        row, then the next set with active sequences, round-robin (attaching a set costs about half a decode)."""
        keys = list(dict.fromkeys(self.group_key(sq.key) for sq in cx.active))
        if not keys:
            return
        if cx.current in keys and cx.streak < QUANTUM:
            key = cx.current
        else:
            key = keys[(keys.index(cx.current) + 1) % len(keys)] if cx.current in keys else keys[0]
            cx.streak = 0
        cx.streak += 1
        group = [sq for sq in cx.active if self.group_key(sq.key) == key]
        self.max_batch_seqs = max(self.max_batch_seqs, len(group))
        refused: list[_Seq] = []  # sequences whose adapters went away meanwhile: already answered and freed
        try:
            if key == PER_SEQUENCE:
                group = self._window(group)
                refused = self._bind(cx, group)
                group = [sq for sq in group if sq not in refused]
                sets = len({sq.key for sq in group if sq.key})  # the base is not an adapter set
                self.max_batch_adapter_sets = max(self.max_batch_adapter_sets, sets)
            else:
                self._attach(cx, key)
            finished = refused + (self._decode(cx, group) if group else [])
            if key == PER_SEQUENCE and cx.restacked:  # llama.cpp re-stacked the sets at this decode
                cx.restacked = False
                self._trim_heap()
            for sq in finished:
                self._finish(cx, sq)
        except Exception as e:  # noqa: BLE001 - this adapter set's requests fail, the others go on
            for sq in group:  # their cells are not what `fed` says: freed, never cached
                sq.out.put(e)
                self._release(cx, sq)
            finished = group + refused
        gone = {id(sq) for sq in finished}
        cx.active = [sq for sq in cx.active if id(sq) not in gone]

    def _window(self, group: list[_Seq]) -> list[_Seq]:
        """The sequences of the first ``max_sets_per_batch`` distinct adapter sets, in admission order (the base
        is not a set): later sets' sequences wait until older ones finish, so none waits for ever."""
        sets: set[tuple] = set()
        chosen = []
        for sq in group:  # cx.active's order: the order of admission
            if sq.key and sq.key not in sets:
                if len(sets) == self.max_sets_per_batch:
                    continue
                sets.add(sq.key)
            chosen.append(sq)
        return chosen

    def _bind(self, cx: _Context, group: list[_Seq]) -> list[_Seq]:
        """Bind each sequence of ``group`` to its own adapter set (per-sequence LoRA), the context's own adapters
        detached; the sequences whose adapters were unloaded or reloaded meanwhile are refused (and freed)."""
        lc = self.lc
        if cx.current != PER_SEQUENCE:
            lc.llama_set_adapters_lora(cx.ctx, None, 0, None)
            cx.current = PER_SEQUENCE
        refused = []
        for sq in group:
            if cx.bound.get(sq.seq_id) == sq.key:
                continue
            with self._lock:
                gone = [name for name, _, gen in sq.key if self._generation.get(name) != gen]
                ptrs = [self._adapters[name] for name, _, _ in sq.key] if not gone else []
            if gone:
                sq.out.put(UserError(f"adapter(s) {gone} were unloaded or reloaded meanwhile", "retry the request"))
                self._release(cx, sq)
                refused.append(sq)
                continue
            cx.restacked |= bool(sq.key) and sq.key not in cx.bound.values()  # a set llama.cpp may not hold yet
            self.seq_lora.bind(cx.ctx, sq.seq_id, ptrs, [scale for _, scale, _ in sq.key])
            cx.bound[sq.seq_id] = sq.key
        return refused

    def _unbind(self, cx: _Context, seq_id: int) -> None:
        """A sequence id returns to the pool: no adapter set stays bound to it (a no-op unless one was: with a stock
        llama.cpp nothing is ever bound)."""
        if cx.bound.pop(seq_id, None):
            self.seq_lora.bind(cx.ctx, seq_id, [], [])

    def _unbind_all(self, cx: _Context) -> None:
        """Forget every binding (an adapter is about to be freed): the active sequences are bound again at their
        next decode."""
        if self.seq_lora is not None:  # always: llama.cpp keeps stacked sets after their sequences are unbound, and
            self.seq_lora.clear(cx.ctx)  # a freed adapter's address may come back with another adapter's weights
            cx.bound.clear()
            cx.restacked = True

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
            self._unbind(cx, sq.seq_id)  # its cells stay valid; its set leaves the stacks at their next rebuild
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
        """Free the cached cells computed with adapter ``name``, and forget the bindings (``name`` is freed)."""
        self._unbind_all(cx)
        for sid in cx.cache.drop(name):
            self._forget(cx, sid)

    def _forget(self, cx: _Context, seq_id: int) -> None:
        self._unbind(cx, seq_id)
        self.lc.llama_memory_seq_rm(cx.mem, seq_id, -1, -1)
        cx.free.append(seq_id)

    def _release_unloaded(self, cx: _Context) -> None:
        """For each adapter being unloaded that no active sequence uses: drop its cached cells and detach it;
        lock held."""
        for name in self._unloading - cx.done_unloads:
            if any(n == name for sq in cx.active for n, _, _ in sq.key):
                continue
            self._drop_cached(cx, name)
            if cx.current and cx.current != PER_SEQUENCE and any(n == name for n, _, _ in cx.current):
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
