"""Per-sequence LoRA in llama.cpp: the C functions tuneport's patch adds (``toolkit/llama_cpp_patches/0001``),
bound with ctypes. ``llama_set_seq_adapters_lora`` binds an adapter set (adapters and scales) to one sequence id, so
one decode batch holds sequences of every adapter set; a stock llama-cpp-python lacks the functions and
:func:`seq_lora` returns None (the engine then attaches one adapter set per decode)."""

from __future__ import annotations

import ctypes
import time

BIND = "llama_set_seq_adapters_lora"
CLEAR = "llama_clear_seq_adapters_lora"
VERSION = "llama_seq_adapters_lora_version"  # absent in the first version of the patch (no token embeddings)


class SeqLora:
    """The two functions of the patched library."""

    def __init__(self, lib) -> None:
        self._bind = getattr(lib, BIND)
        self._bind.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                               ctypes.POINTER(ctypes.c_float)]
        self._bind.restype = ctypes.c_int32
        self._clear = getattr(lib, CLEAR)
        self._clear.argtypes = [ctypes.c_void_p]
        self._clear.restype = None
        version = getattr(lib, VERSION, None)
        if version is not None:
            version.argtypes, version.restype = [], ctypes.c_int32
        self.version = int(version()) if version is not None else 1

    def binds(self, tensor: str, shape: tuple) -> bool:
        """Whether the library binds a LoRA tensor of this name and shape per sequence: 2-D ones (no experts), the
        token embeddings' from version 2."""
        return len(shape) == 2 and (self.version >= 2 or not tensor.startswith("token_embd."))

    def bind(self, ctx, seq_id: int, adapters: list, scales: list[float]) -> None:
        """Bind ``adapters`` (llama_adapter_lora pointers) with ``scales`` to ``seq_id``; none unbinds it."""
        n = len(adapters)
        ptrs = (ctypes.c_void_p * max(n, 1))(*(ctypes.cast(a, ctypes.c_void_p) for a in adapters))
        values = (ctypes.c_float * max(n, 1))(*scales)
        if self._bind(ctypes.cast(ctx, ctypes.c_void_p), seq_id, ptrs, n, values) != 0:
            raise RuntimeError(f"llama.cpp refused to bind adapters to sequence {seq_id}")

    def clear(self, ctx) -> None:
        """Unbind every sequence and forget the stacked sets (before an adapter a sequence used is freed)."""
        self._clear(ctypes.cast(ctx, ctypes.c_void_p))


class HeapTrim:
    """Gives the C heap's free pages back after llama.cpp re-stacked the bound sets (glibc's ``malloc_trim``, at most
    once per ``interval_s``). Each re-stack frees the old stacks and allocates new ones; under adapter churn the
    freed blocks fragment the heap and RSS creeps up (measured in the 60 s soak: +4.9% alone, +11% beside the test
    suite; with the trim the same as the fallback's). A no-op where the C library has no ``malloc_trim``."""

    def __init__(self, interval_s: float = 1.0) -> None:
        try:
            self._trim = ctypes.CDLL(None).malloc_trim
            self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            self._trim = None
        self.interval_s = interval_s
        self._last = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.interval_s:
            self._last = now
            self._trim(0)


def batching_label(seq: SeqLora | None) -> str:
    """How requests for different adapter sets decode, as doctor, describe() and the start-up line say it."""
    return "per-sequence (one batch)" if seq is not None else "one adapter set per decode"


def seq_lora(llama_cpp) -> SeqLora | None:
    """The per-sequence functions of the loaded llama.cpp, or None when it is a stock build."""
    lib = llama_cpp.llama_cpp._lib
    return SeqLora(lib) if hasattr(lib, BIND) and hasattr(lib, CLEAR) else None
