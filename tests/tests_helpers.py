"""Helpers shared by engine and server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from tuneport.serve.engines.vllm import free_port
from tuneport.toolkit.fidelity import llamacpp_greedy

__all__ = ["Running", "free_port", "fresh_greedy", "run_threads"]


class Running:
    """A uvicorn server on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.srv.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.srv.should_exit = True
        self.thread.join(timeout=30)


def run_threads(target: Callable, args: Iterable[tuple], timeout: float | None = None) -> None:
    """Run ``target(*a)`` for each ``a`` in its own thread, all at once; wait for all."""
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def fresh_greedy(model, lora, prompt, n):
    """``n`` greedy tokens from a fresh llama.cpp instance holding only ``lora`` (or no adapter)."""
    return llamacpp_greedy(model, lora, prompt, n)
