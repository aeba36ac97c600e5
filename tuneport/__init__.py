"""tuneport: merge, export, verify and serve LoRA fine-tunes, from Python.

Every command of the ``tuneport`` CLI is a function here taking the same options (one options object per
command, or its fields as keywords); the CLI builds the same objects and calls the same functions::

    import tuneport

    tuneport.merge(base="./base", adapters=["./lora"], out="./merged")
    result = tuneport.export(base="./base", adapters=["chat=./lora"], target="gguf", adapter_mode="separate",
                             quant="q8_0", out="./gguf")
    print(tuneport.inspect(result.out / "base-Q8_0.gguf")["engines"])
    with tuneport.serve(base="./base", adapters={"chat": "./lora"}, port=0) as server:
        print(server.url)  # an OpenAI-compatible API: model="chat" picks the adapter

Bad input raises :class:`UserError` (``message`` says what is wrong, ``hint`` what to do).
The machinery lives in ``tuneport.convert``, ``tuneport.serve`` and ``tuneport.toolkit``. The attribute
``tuneport.serve`` is the function; import the subpackage's modules by their full names
(``from tuneport.serve.gateway import create_app``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .convert import __version__
from .convert.errors import FidelityError, UserError
from .convert.export import export, merge
from .convert.options import AdapterSpec, ExportOptions, ExportResult, MergeOptions
from .serve.options import ServeOptions
from .serve.server import Server, serve
from .serve.server import plan as serve_plan

if TYPE_CHECKING:
    from .toolkit.doctor import doctor_report as doctor
    from .toolkit.inspect import inspect_path as inspect
    from .toolkit.llama_wheel import LlamaWheelOptions, build_llama_wheel
    from .toolkit.verify import VerifyOptions, VerifyReport, verify

__all__ = [
    "AdapterSpec", "ExportOptions", "ExportResult", "FidelityError", "LlamaWheelOptions", "MergeOptions", "Server",
    "ServeOptions", "UserError", "VerifyOptions", "VerifyReport", "__version__", "build_llama_wheel", "doctor",
    "export", "inspect", "merge", "serve", "serve_plan", "verify",
]

# Imported on first use (inspect, doctor and verify read models with torch), so `import tuneport` stays light.
_LAZY = {"inspect": ("tuneport.toolkit.inspect", "inspect_path"),
         "doctor": ("tuneport.toolkit.doctor", "doctor_report"),
         "verify": ("tuneport.toolkit.verify", "verify"),
         "VerifyOptions": ("tuneport.toolkit.verify", "VerifyOptions"),
         "VerifyReport": ("tuneport.toolkit.verify", "VerifyReport"),
         "build_llama_wheel": ("tuneport.toolkit.llama_wheel", "build_llama_wheel"),
         "LlamaWheelOptions": ("tuneport.toolkit.llama_wheel", "LlamaWheelOptions")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tuneport' has no attribute {name!r}")
