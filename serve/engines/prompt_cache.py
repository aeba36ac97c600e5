"""Which finished sequences' KV cells a llama.cpp decode loop keeps, and which one a new prompt may reuse.

An entry is the tokens a finished sequence decoded, under one adapter set (names, scales and load
generations), held by a sequence id of the context. A new request reuses the longest common prefix of an
entry with the same adapter set only: cells computed under one adapter set are never read under another
(llama-server's RAM cache does, upstream llama.cpp issue 26207). Entries are bounded in number (sequence ids)
and evicted least recently used; the decode loop frees their cells.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CacheEntry:
    key: tuple  # the adapter set ((name, scale, generation), ...)
    tokens: list[int]  # the tokens whose cells the sequence holds, positions 0..len-1
    seq_id: int


@dataclass
class CacheStats:
    hits: int = 0
    hit_tokens: int = 0
    misses: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PromptCache:
    """LRU entries of one context (all bookkeeping; the loop does the llama.cpp calls)."""

    capacity: int
    entries: OrderedDict[int, CacheEntry] = field(default_factory=OrderedDict)  # seq id -> entry, oldest first
    stats: CacheStats = field(default_factory=CacheStats)

    def lookup(self, key: tuple, prompt: list[int]) -> tuple[CacheEntry, int] | None:
        """The entry with the same adapter set sharing the longest prefix with ``prompt``, and how many tokens
        to reuse (at most all but the last: its logits are needed). None, and a miss, when nothing is shared."""
        best, length = None, 0
        for e in self.entries.values():
            if e.key == key and (n := min(common_prefix(e.tokens, prompt), len(prompt) - 1)) > length:
                best, length = e, n
        if best is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(best.seq_id)
        self.stats.hits += 1
        self.stats.hit_tokens += length
        return best, length

    def add(self, key: tuple, tokens: list[int], seq_id: int) -> list[int]:
        """Keep ``seq_id``'s cells as an entry; the sequence ids whose cells the loop must now free (an entry
        this one covers, this one if another covers it, the oldest beyond capacity)."""
        freed = []
        for e in list(self.entries.values()):
            if e.key != key:
                continue
            shared = common_prefix(e.tokens, tokens)
            if shared == len(tokens):  # an entry already holds all of these
                self.entries.move_to_end(e.seq_id)
                return [seq_id]
            if shared == len(e.tokens):  # this one extends an entry: keep the longer
                freed.append(self.entries.pop(e.seq_id).seq_id)
        self.entries[seq_id] = CacheEntry(key, list(tokens), seq_id)
        while len(self.entries) > self.capacity:
            freed.append(self.evict())
        return freed

    def evict(self, keep: int | None = None) -> int:
        """Drop the least recently used entry (other than the one holding ``keep``); its sequence id."""
        victim = next(sid for sid in self.entries if sid != keep)
        return self.entries.pop(victim).seq_id

    def drop(self, name: str) -> list[int]:
        """Drop every entry whose adapter set holds adapter ``name`` (unloaded or reloaded); their sequence ids."""
        gone = [sid for sid, e in self.entries.items() if any(n == name for n, _, _ in e.key)]
        for sid in gone:
            del self.entries[sid]
        return gone

    def __len__(self) -> int:
        return len(self.entries)
