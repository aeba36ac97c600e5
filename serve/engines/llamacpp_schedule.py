"""The decode loop's scheduling: which waiting requests each context admits (its own adapter set first, then an idle
context, then a new one up to ``n_contexts``), one turn of the loop at a time."""

from __future__ import annotations

import logging

from tuneport.convert.errors import UserError

from .llamacpp_state import _Context, _Seq

log = logging.getLogger(__package__ + ".llamacpp")  # the engine's logger


class Scheduler:
    """The decode loop's scheduling (a part of :class:`~.llamacpp.LlamaCppEngine`, which holds the state)."""

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
        keys = {id(cx): {self.group_key(sq.key) for sq in cx.active} for cx in self._contexts}
        placed: dict[int, list[list[_Seq]]] = {}
        while self._pending:
            group = self._pending[0]
            if any(n in self._unloading for n, _, _ in group[0].key):
                self._pending.pop(0)
                group[0].out.put(UserError("the request's adapter is being unloaded", "retry the request"))
                for sq in group:
                    self._free_grammar(sq)
                continue
            key = self.group_key(group[0].key)  # every set bound per sequence counts as one: they decode together
            cx = self._place(key, len(group), room, keys)
            if cx is None:
                return placed, len(self._contexts) < self.n_contexts
            self._pending.pop(0)
            placed.setdefault(id(cx), []).append(group)
            room[id(cx)] -= len(group)
            keys[id(cx)].add(key)
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
                lo, hi = (lc.llama_memory_seq_pos_min(cx.mem, first.seq_id),
                          lc.llama_memory_seq_pos_max(cx.mem, first.seq_id)) if self.n_swa else (0, n - 1)
                if lo < 0 or lo > max(0, n - self.n_swa) or hi < n - 1:
                    # a sliding-window cache dropped cells this prefix still needs (once the cached sequence ran a
                    # window past the prefix, none of the prefix's last cells is left: the copy is empty): start afresh
                    lc.llama_memory_seq_rm(cx.mem, first.seq_id, -1, -1)
                    cx.cache.stats.hits -= 1
                    cx.cache.stats.hit_tokens -= n
                    cx.cache.stats.misses += 1
                else:
                    first.pos, first.fed = n, list(first.req.prompt_tokens[:n])
