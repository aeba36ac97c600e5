"""What a checkpoint's ``quantization_config`` says, in the words users know, and which of these tuneport reads."""

from __future__ import annotations

from .int4 import quant_info

# quant_method -> how users call it
METHOD_NAMES = {
    "bitsandbytes": "bitsandbytes", "gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors",
    "mxfp4": "MXFP4", "fp8": "FP8", "hqq": "HQQ", "eetq": "EETQ", "aqlm": "AQLM", "quanto": "Quanto",
    "torchao": "torchao", "bitnet": "BitNet", "fbgemm_fp8": "FP8 (fbgemm)", "higgs": "HIGGS", "vptq": "VPTQ",
}


def storage_method(quantization_config: dict | None) -> str | None:
    """The storage method, e.g. "bitsandbytes 4-bit (nf4)", "MXFP4", "AWQ 4-bit"; None when not quantized."""
    if not isinstance(quantization_config, dict) or not quantization_config:
        return None
    method = str(quantization_config.get("quant_method") or "")
    if method == "bitsandbytes" or quantization_config.get("load_in_4bit") or quantization_config.get("load_in_8bit"):
        if quantization_config.get("load_in_8bit"):
            return "bitsandbytes 8-bit"
        return f"bitsandbytes 4-bit ({quantization_config.get('bnb_4bit_quant_type', 'fp4')})"
    info = quant_info(quantization_config)
    if info is not None:
        return f"{METHOD_NAMES[method]} {info['bits']}-bit"
    return METHOD_NAMES.get(method, method or "an unknown method")
