"""MLX LM (mlx-lm 0.32) models and adapters.

``quant`` is the table of mlx-lm's quantizers (affine 2–8 bits, mxfp4, nvfp4, mxfp8, mixed recipes) and
the tensor-by-tensor quantizer that calls ``mlx.core.quantize``; ``archs`` the config keys mlx-lm reads
only at the top level, per architecture; ``arrays`` moves tensors between torch and mlx; ``adapters``
turns PEFT adapters into mlx-lm's ``adapters.safetensors``; ``export`` is the ``--target mlx`` writer;
``read`` recognises MLX model and adapter directories (``inspect``, serve, verify).

This module imports neither torch nor mlx: the CLI lists its choices from here.
"""

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_PARTS = ("lora_a", "lora_b", "m")  # an mlx-lm adapter's tensors per module (m: DoRA magnitude)
DEFAULT_SCALE = 20.0  # mlx-lm's LoRA scale when lora_parameters gives none
# Quantization types (--quant); see quant.QUANT_TYPES for what each means.
QUANT_NAMES = ("q2", "q3", "q4", "q5", "q6", "q8", "mxfp4", "nvfp4", "mxfp8",
               "mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx-lm's default for affine quantization
INSTALL_HINT = "pip install 'tuneport[mlx]' (mlx[cpu] on Linux, mlx on Apple Silicon)"


def require_mlx() -> None:
    """mlx (imported: it must run here) and mlx-lm (found; importing it costs seconds of transformers)."""
    import importlib.util

    from ..errors import UserError

    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        raise UserError(f"--target mlx needs mlx ({e})", INSTALL_HINT) from None
    if importlib.util.find_spec("mlx_lm") is None:
        raise UserError("--target mlx needs mlx-lm, which is not installed", INSTALL_HINT)
