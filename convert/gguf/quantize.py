"""Every non-Python quantization type goes through llama.cpp's own quantizer."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from .quant_types import QuantType


def quantize_with_llamacpp(src: Path, dst: Path, qt: QuantType, nthread: int = 0) -> None:
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError(f"--quant {qt.name} needs llama.cpp's quantizer", "pip install 'tuneport[llamacpp]'") from e
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = qt.ftype
    params.nthread = nthread
    with quiet_llamacpp():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {qt.label}) failed with code {rc}")


_SILENT = None


@contextlib.contextmanager
def quiet_llamacpp() -> Iterator[None]:
    """Route llama.cpp's log lines nowhere (its quantizer prints every tensor on stderr)."""
    global _SILENT
    import llama_cpp

    if _SILENT is None:
        _SILENT = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_SILENT, ctypes.c_void_p())
    yield
