"""Every non-Python quantization type goes through llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
from pathlib import Path

from ..errors import UserError
from .imatrix import IMatrix, llamacpp_imatrix
from .quant_types import QuantType
from .runtime import llamacpp_logging

IMATRIX_HINT = "pass --calib FILE (or --calib-samples N for the built-in calibration text)"


def quantize_with_llamacpp(src: Path, dst: Path, qt: QuantType, nthread: int = 0,
                           imatrix: IMatrix | None = None) -> None:
    """``src`` (F32/F16/BF16 GGUF) -> ``dst`` in ``qt``; ``imatrix`` weighs each column's rounding error."""
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError(f"--quant {qt.name} needs llama.cpp's quantizer", "pip install 'tuneport[llamacpp]'") from e
    if qt.needs_imatrix and imatrix is None:
        raise UserError(f"--quant {qt.name} needs an importance matrix", IMATRIX_HINT)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = qt.ftype
    params.nthread = nthread
    data = llamacpp_imatrix(imatrix) if imatrix is not None else None  # must outlive the call
    if data is not None:
        params.imatrix = data.pointer()
    with llamacpp_logging():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {qt.label}) failed with code {rc}")
