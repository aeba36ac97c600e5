"""Every non-Python quantization type goes through llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
from pathlib import Path

from ..errors import UserError
from .quant_types import QuantType
from .runtime import llamacpp_logging


def quantize_with_llamacpp(src: Path, dst: Path, qt: QuantType, nthread: int = 0) -> None:
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError(f"--quant {qt.name} needs llama.cpp's quantizer", "pip install 'tuneport[llamacpp]'") from e
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = qt.ftype
    params.nthread = nthread
    with llamacpp_logging():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {qt.label}) failed with code {rc}")
