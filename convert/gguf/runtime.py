"""llama.cpp (through llama-cpp-python) as tuneport calls it: its log lines go to ``logging`` at DEBUG
(logger ``tuneport.llamacpp``) while tuneport calls into it, and its previous log callback is put back
afterwards, so a failed load says why with ``--log-level debug`` and nothing else in the process changes."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

log = logging.getLogger("tuneport.llamacpp")
_lock = threading.Lock()
_state: dict = {"depth": 0, "saved": None, "callback": None, "partial": "", "level": 0, "errors": None}
GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5  # ggml_log_level: a CONT piece continues the line's level


def _forward(level: int, text: bytes, user_data) -> None:
    """llama.cpp log callback: whole lines to ``log.debug`` (llama.cpp sends a line in pieces); error lines
    also to the list :func:`llamacpp_errors` collects, when one does."""
    with _lock:
        if level != GGML_LOG_LEVEL_CONT:
            _state["level"] = level
        buf = _state["partial"] + text.decode("utf-8", "replace")
        *lines, _state["partial"] = buf.split("\n")
        errors = _state["errors"] if _state["level"] == GGML_LOG_LEVEL_ERROR else None
        if errors is not None:
            errors += [line.strip() for line in lines if line.strip()]
    for line in lines:
        if line.strip():
            log.debug("%s", line.rstrip())


@contextlib.contextmanager
def llamacpp_logging() -> Iterator[None]:
    """Route llama.cpp's log into ``logging`` for the duration (re-entrant, thread-safe)."""
    import llama_cpp

    with _lock:
        if _state["depth"] == 0:
            if _state["callback"] is None:
                _state["callback"] = llama_cpp.llama_log_callback(_forward)
            previous, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
            llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(user_data))
            _state["saved"] = (previous, user_data)
            llama_cpp.llama_log_set(_state["callback"], ctypes.c_void_p())
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                llama_cpp.llama_log_set(*_state["saved"])
                _state["saved"] = None


@contextlib.contextmanager
def llamacpp_errors() -> Iterator[list[str]]:
    """llama.cpp's log routed as :func:`llamacpp_logging` does, and its error lines collected meanwhile."""
    errors: list[str] = []
    with llamacpp_logging():
        with _lock:
            previous, _state["errors"] = _state["errors"], errors
        try:
            yield errors
        finally:
            with _lock:
                _state["errors"] = previous


def llamacpp_reason(errors: list[str]) -> str:
    """The most telling of llama.cpp's error lines: the loader's own reason when it gave one, else the last."""
    for line in errors:
        if "error loading model: " in line:
            return line.split("error loading model: ", 1)[1]
    return errors[-1].split(": ", 1)[-1] if errors else "no reason logged"


def check_loads(model: Path, loras: Sequence[Path] = ()) -> None:
    """Prove llama.cpp loads ``model`` (its vocabulary, metadata and every tensor's name, type and shape, the
    data mapped, not evaluated) and each GGUF LoRA in ``loras`` against it; UserError with llama.cpp's reason
    otherwise."""
    import llama_cpp as lc

    with llamacpp_errors() as errors:
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_mmap = True
        params.use_extra_bufts = False  # no weight repacking: nothing is read that the check does not need
        model_ptr = lc.llama_model_load_from_file(str(model).encode(), params)
        if not model_ptr:
            raise UserError(f"llama.cpp cannot load the exported {model.name}: {llamacpp_reason(errors)}",
                            "this export would not run; report it with the input that produced it")
        try:
            for path in loras:
                adapter = lc.llama_adapter_lora_init(model_ptr, str(path).encode())
                if not adapter:
                    raise UserError(f"llama.cpp cannot load the exported adapter {path.name}: "
                                    f"{llamacpp_reason(errors)}",
                                    "this export would not run; report it with the input that produced it")
                lc.llama_adapter_lora_free(adapter)
        finally:
            lc.llama_model_free(model_ptr)


def current_log_callback() -> int | None:
    """The address of llama.cpp's current log callback (for tests: it is restored after each call)."""
    import llama_cpp

    cb, user_data = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(cb), ctypes.byref(user_data))
    return ctypes.cast(cb, ctypes.c_void_p).value


def chat_renderer(template: str, bos_text: str, eos_text: str) -> Callable[..., tuple[str, bool]]:
    """A GGUF's chat template compiled once, rendered as llama-cpp-python renders it: ``messages, tools=None ->
    (prompt text, whether tokenizing it adds BOS)``. ``tuneport serve`` and ``tuneport verify`` both use it."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template, eos_token=eos_text, bos_token=bos_text)

    def render(messages: list[dict], tools: list[dict] | None = None) -> tuple[str, bool]:
        res = formatter(messages=messages, tools=tools)
        return res.prompt, not res.added_special

    return render


@dataclass(frozen=True)
class LongRopeChoice:
    """Which LongRoPE factors a llama.cpp context rotates with. llama.cpp takes ``rope_factors_long`` whenever the
    context's cells per sequence exceed ``rope.scaling.original_context_length``; transformers takes the long factors
    only for a sequence longer than that. A server's unified cache has many requests' cells, so its contexts would
    rotate even short requests with the long factors: when no request can outgrow the original context, the key is
    raised to the cells (``override``) and every request rotates as transformers does."""

    override: dict[str, int]  # GGUF key -> value, for llama_model_params.kv_overrides (empty: none)
    note: str | None  # what differs from transformers, when something does


def longrope_choice(header, cells: int, request_ctx: int) -> LongRopeChoice:
    """For a GGUF ``header`` (``read.open_gguf``) loaded into contexts of ``cells`` cells (llama.cpp pads to 256)
    serving requests of at most ``request_ctx`` tokens."""
    arch = header.fields.get("general.architecture")
    key = f"{arch}.rope.scaling.original_context_length"
    original = header.fields.get(key)
    if not any(t.name == "rope_factors_long.weight" for t in header.tensors) or not isinstance(original, int):
        return LongRopeChoice({}, None)
    padded = -(-cells // 256) * 256
    if padded <= original:
        return LongRopeChoice({}, None)
    if request_ctx <= original:
        return LongRopeChoice({key: padded}, None)
    return LongRopeChoice({}, f"n_ctx {request_ctx} is past LongRoPE's original context of {original}: llama.cpp "
                                f"rotates every request with the long factors, transformers only a sequence longer "
                                f"than {original} tokens (shorter ones differ slightly; --n-ctx {original} or less "
                                f"rotates them as transformers does)")


def kv_overrides(llama_cpp, values: dict[str, int]):
    """A ``llama_model_kv_override`` array for ``llama_model_params.kv_overrides`` (integers; an empty key ends it).
    Assigned to a params field, ctypes keeps it alive with the params."""
    arr = (llama_cpp.llama_model_kv_override * (len(values) + 1))()
    for item, (key, value) in zip(arr, values.items(), strict=False):
        item.key = key.encode()
        item.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
        item.value.val_i64 = value
    return arr
