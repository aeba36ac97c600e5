"""The quantization types tuneport writes, as data: how each is produced and what llama.cpp calls it."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class QuantType:
    name: str  # as users type it: q4_k_m
    label: str  # in file names: Q4_K_M
    ftype: int  # llama.cpp LLAMA_FTYPE_* / general.file_type
    direct: str | None = None  # GGMLQuantizationType name when tuneport writes it from Python
    k_quant: bool = False  # needs rows divisible by 256 (else llama.cpp falls back to other types)
    needs_imatrix: bool = False  # llama.cpp refuses to write it without an importance matrix (--calib)


QUANT_TYPES: dict[str, QuantType] = {q.name: q for q in [
    QuantType("f32", "F32", 0, direct="F32"),
    QuantType("f16", "F16", 1, direct="F16"),
    QuantType("bf16", "BF16", 32, direct="BF16"),
    QuantType("q8_0", "Q8_0", 7, direct="Q8_0"),
    # llama.cpp's MXFP4_MOE (gpt-oss as released): stacked experts MXFP4 (E2M1 in blocks of 32 with a power-of-two
    # scale), the other matrices Q8_0. Experts read from MXFP4 keep their values exactly (ggml's quantizer gives a
    # block of MXFP4 numbers back unchanged), so a released gpt-oss converts without a 16-bit copy
    QuantType("mxfp4_moe", "MXFP4_MOE", 38, direct="MXFP4_MOE"),
    QuantType("q4_0", "Q4_0", 2),
    QuantType("q4_1", "Q4_1", 3),
    QuantType("q5_0", "Q5_0", 8),
    QuantType("q5_1", "Q5_1", 9),
    QuantType("q2_k", "Q2_K", 10, k_quant=True),
    QuantType("q3_k_s", "Q3_K_S", 11, k_quant=True),
    QuantType("q3_k_m", "Q3_K_M", 12, k_quant=True),
    QuantType("q3_k_l", "Q3_K_L", 13, k_quant=True),
    QuantType("q4_k_s", "Q4_K_S", 14, k_quant=True),
    QuantType("q4_k_m", "Q4_K_M", 15, k_quant=True),
    QuantType("q5_k_s", "Q5_K_S", 16, k_quant=True),
    QuantType("q5_k_m", "Q5_K_M", 17, k_quant=True),
    QuantType("q6_k", "Q6_K", 18, k_quant=True),
    QuantType("q2_k_s", "Q2_K_S", 21, k_quant=True, needs_imatrix=True),
    # i-quants (ftypes: llama_cpp.LLAMA_FTYPE_MOSTLY_*). llama.cpp requires an importance matrix for every
    # tensor it writes as IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS (src/llama-quant.cpp, tensor_requires_imatrix):
    # iq3_xs writes q/k (and middle ffn_gate/up) as IQ3_XXS; iq3_s, iq3_m, iq4_nl and iq4_xs need none.
    QuantType("iq1_s", "IQ1_S", 24, k_quant=True, needs_imatrix=True),
    QuantType("iq1_m", "IQ1_M", 31, k_quant=True, needs_imatrix=True),
    QuantType("iq2_xxs", "IQ2_XXS", 19, k_quant=True, needs_imatrix=True),
    QuantType("iq2_xs", "IQ2_XS", 20, k_quant=True, needs_imatrix=True),
    QuantType("iq2_s", "IQ2_S", 28, k_quant=True, needs_imatrix=True),
    QuantType("iq2_m", "IQ2_M", 29, k_quant=True, needs_imatrix=True),
    QuantType("iq3_xxs", "IQ3_XXS", 23, k_quant=True, needs_imatrix=True),
    QuantType("iq3_xs", "IQ3_XS", 22, k_quant=True, needs_imatrix=True),
    QuantType("iq3_s", "IQ3_S", 26, k_quant=True),
    QuantType("iq3_m", "IQ3_M", 27, k_quant=True),
    QuantType("iq4_nl", "IQ4_NL", 25),
    QuantType("iq4_xs", "IQ4_XS", 30, k_quant=True),
]}
DEFAULT_QUANT = "q4_k_m"
# tuneport's --dtype -> the lossless GGUF type an HF base becomes when llama.cpp serves it (auto: F16, as
# llama.cpp's own converter does), and the bytes per weight of those types
GGUF_FOR_DTYPE = {"auto": "f16", "fp16": "f16", "bf16": "bf16", "fp32": "f32"}
FLOAT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def parse_quant_list(text: str | None) -> list[QuantType]:
    """``"q8_0,q4_k_m"`` -> QuantTypes, in order, without duplicates."""
    names = [n.strip().lower() for n in (text or DEFAULT_QUANT).split(",") if n.strip()]
    bad = [n for n in names if n not in QUANT_TYPES]
    if bad:
        raise UserError(f"unknown --quant {', '.join(bad)}", f"choose from {', '.join(QUANT_TYPES)}")
    return [QUANT_TYPES[n] for n in dict.fromkeys(names)]
