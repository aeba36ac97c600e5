"""Activation-aware 4-bit weight quantization (AWQ, arXiv 2306.00978), one decoder block at a time.

``quant`` is the group-wise integer math, ``formats`` the two checkpoint layouts vLLM loads
(compressed-tensors ``pack-quantized`` and AutoAWQ GEMM), ``search`` the scale and clipping searches, ``core``
one block's AWQ and ``export`` the ``--target awq`` writer. The calibration text and the streaming pass through
the decoder layers are ``convert.calibration``'s, shared with llama.cpp's importance matrix (``gguf.imatrix``).
"""

# Choices the CLI and recipes list without importing torch (checked against the tables in quant / formats).
FORMAT_NAMES = ("compressed-tensors", "awq-gemm")
GROUP_SIZES = (32, 64, 128)
