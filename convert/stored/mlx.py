"""mlx-lm's quantized weights: each quantized module's weight packed in uint32 (``32 / bits`` values per word)
beside ``scales`` and ``biases`` per group; the config's ``quantization`` gives the defaults and, for mixed
recipes, each module's own entry."""

from __future__ import annotations

# where mlx-lm's wrapper models (Qwen3.5's) keep the text model in their tree: per-module entries are keyed by those
# paths, the weights by the checkpoint's own names
WRAPPER_PREFIXES = ("language_model.",)


def module_quant(quant: dict, module: str) -> dict:
    """A quantized module's {mode, bits, group_size}: its own entry (mixed recipes) over the defaults."""
    entry = next((quant[k] for k in (module, *(p + module for p in WRAPPER_PREFIXES)) if k in quant), None)
    top = {"mode": quant.get("mode") or "affine", "bits": quant.get("bits"), "group_size": quant.get("group_size")}
    return {**top, **entry} if isinstance(entry, dict) else top


def unpacked_shape(quant: dict, module: str, packed: tuple[int, ...]) -> tuple[int, ...]:
    """``[out, in]`` of a quantized module whose packed uint32 weight has shape ``packed``."""
    bits = module_quant(quant, module)["bits"]
    return (*packed[:-1], packed[-1] * 32 // int(bits))
