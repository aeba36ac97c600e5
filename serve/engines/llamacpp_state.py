"""The llama.cpp engine's data: a sequence in the decode loop, a context and its sequences, the batch filled from
numpy arrays, and the decode loop's constants."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .base import Sequence
from .prompt_cache import PromptCache


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


# The decode loop's name for the sequences bound to their adapter sets one by one (llama.cpp with per-sequence LoRA):
# they decode together, whatever their sets, as if they had one.
PER_SEQUENCE = ("per-sequence adapter sets",)

# Distinct adapter sets one per-sequence batch decodes (--max-sets-per-batch): sequences of further sets wait,
# oldest first. Every change of the bound sets re-stacks their LoRA matrices in llama.cpp (their size times the
# sets), so the limit bounds that cost and the stacks' memory; chosen by benchmarks/serve_llamacpp.py --sets-sweep.
DEFAULT_MAX_SETS_PER_BATCH = 8

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
    bound: dict[int, tuple] = field(default_factory=dict)  # sequence id -> the adapter set bound to it
    restacked: bool = False  # a set was bound that llama.cpp may not have stacked: it re-stacks at the next decode
