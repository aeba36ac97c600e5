"""llama.cpp (through llama-cpp-python) as tuneport calls it: its log lines go to ``logging`` at DEBUG
(logger ``tuneport.llamacpp``) while tuneport calls into it, and its previous log callback is put back
afterwards, so a failed load says why with ``--log-level debug`` and nothing else in the process changes."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("tuneport.llamacpp")
_lock = threading.Lock()
_state: dict = {"depth": 0, "saved": None, "callback": None, "partial": ""}


def _forward(level: int, text: bytes, user_data) -> None:
    """llama.cpp log callback: whole lines to ``log.debug`` (llama.cpp sends a line in pieces)."""
    with _lock:
        buf = _state["partial"] + text.decode("utf-8", "replace")
        *lines, _state["partial"] = buf.split("\n")
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
