"""Helpers shared by engine and server tests."""

from __future__ import annotations

import re
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


def llamacpp_gelu():
    """A context in which transformers' tanh-GELU computes as llama.cpp's CPU backend does: through ggml's fp16
    table (ggml-cpu/vec.h, GGML_GELU_FP16: the input rounded to fp16, the table's fp16 value; 0 below -10, the
    input above 10). A Gemma GGUF compared with this reference shows the writer's error alone."""
    import contextlib
    import math

    import torch
    from transformers.activations import GELUTanh

    def table_gelu(x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float16).to(torch.float32)
        g = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * h * (1.0 + 0.044715 * h * h)))
        y = g.to(torch.float16).to(x.dtype)
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))

    @contextlib.contextmanager
    def patched():
        original = GELUTanh.forward
        GELUTanh.forward = lambda self, x: table_gelu(x)
        try:
            yield
        finally:
            GELUTanh.forward = original

    return patched()


def render_ollama(template: str, system: str | None, prompt: str) -> str:
    """An Ollama Modelfile TEMPLATE (the subset tuneport writes: ``{{ if .X }}A{{ else }}B{{ end }}``,
    ``{{ if .X }}A{{ end }}`` and ``{{ .X }}``) rendered for one turn, cut where the response goes, as Ollama
    renders a prompt."""
    values = {"System": system or "", "Prompt": prompt}
    text = template.split("{{ .Response }}")[0]
    text = re.sub(r"{{ if \.(\w+) }}(.*?)(?:{{ else }}(.*?))?{{ end }}",
                  lambda m: m[2] if values[m[1]] else (m[3] or ""), text, flags=re.S)
    return re.sub(r"{{ \.(\w+) }}", lambda m: values[m[1]], text)


def base_with_config(src, out, **changes):
    """A copy of the model directory ``src`` at ``out`` with ``changes`` written into its config.json."""
    import json
    import shutil
    from pathlib import Path

    out = Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **changes}))
    return out
