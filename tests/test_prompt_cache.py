"""The prompt cache's bookkeeping (serve.engines.prompt_cache): a prefix is reused only under the identical
adapter set, all but the last prompt token, the longest entry wins, LRU eviction, covering entries, unload."""

from __future__ import annotations

from tuneport.serve.engines.prompt_cache import PromptCache

A = (("a", 1.0, 1),)
A_RELOADED = (("a", 1.0, 2),)
A_HALF = (("a", 0.5, 1),)
B = (("b", 1.0, 3),)
BASE = ()


def test_reuse_only_under_the_identical_adapter_set():
    c = PromptCache(4)
    assert c.add(A, [1, 2, 3, 4, 5], seq_id=10) == []
    for key in (B, BASE, A_RELOADED, A_HALF):  # another adapter, the base, a reload, another scale: never
        assert c.lookup(key, [1, 2, 3, 4, 5, 6]) is None
    entry, n = c.lookup(A, [1, 2, 3, 4, 5, 6])
    assert entry.seq_id == 10 and n == 5
    _, n = c.lookup(A, [1, 2, 3, 4, 5])  # the whole prompt cached: its last token is decoded again for logits
    assert n == 4
    assert c.lookup(A, [9, 9]) is None
    assert (c.stats.hits, c.stats.hit_tokens, c.stats.misses) == (2, 9, 5)


def test_longest_prefix_lru_and_covering_entries():
    c = PromptCache(2)
    c.add(A, [1, 2, 9], seq_id=1)
    c.add(A, [1, 2, 3, 4], seq_id=2)
    assert c.lookup(A, [1, 2, 3, 4, 7])[0].seq_id == 2  # the longest shared prefix
    assert c.add(A, [1, 2, 3], seq_id=3) == [3]  # covered by entry 2: this one is freed at once
    assert c.add(A, [1, 2, 3, 4, 5, 6], seq_id=4) == [2]  # extends entry 2: the shorter goes
    assert c.add(B, [7, 7], seq_id=5) == [1]  # over capacity: the least recently used goes
    assert sorted(c.entries) == [4, 5]
    assert c.drop("a") == [4] and c.drop("b") == [5] and len(c) == 0
