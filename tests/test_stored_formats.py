"""Quantized storage formats (convert/stored/): decoded exactly as transformers decodes them, and named as users
know them, below the checkpoint reader (which imports them; they import nothing of the writers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tuneport.convert.stored.methods import storage_method
from tuneport.convert.stored.mxfp4 import decode, decoded_shape, encode

STORED = Path(__file__).resolve().parents[1] / "convert" / "stored"


def test_mxfp4_decodes_as_transformers_dequantizes_gpt_oss_experts():
    """gpt-oss's expert blocks and scales (every byte value, scales across the exponent range) decode to the values
    transformers' own dequantizer gives, which transposes them to its [experts, in, out] layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 6, 3, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble, both halves
    scales = torch.randint(90, 160, (4, 6, 3), dtype=torch.uint8, generator=g)
    ours = decode(blocks, scales)
    assert ours.shape == decoded_shape(tuple(blocks.shape)) == (4, 6, 96)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        assert torch.equal(decode(blocks, scales, dtype).transpose(1, 2), ref)


def test_mxfp4_encodes_as_ggml_quantizes_and_keeps_mxfp4_numbers():
    """encode (what the tiny MXFP4 checkpoints are written with) gives the values ggml's reference quantizer gives
    (gguf-py's MXFP4), and MXFP4 numbers come back unchanged."""
    import gguf

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.1
    ours = decode(*encode(x))
    kind = gguf.GGMLQuantizationType.MXFP4
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), kind), kind)))
    assert torch.equal(decode(*encode(ours)), ours)


def test_mxfp4_refuses_blocks_that_do_not_fit_their_scales():
    with pytest.raises(ValueError, match="do not fit"):
        decode(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


@pytest.mark.parametrize("config, name", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes 4-bit (nf4)"),
    ({"load_in_8bit": True}, "bitsandbytes 8-bit"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}, "MXFP4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "AWQ 4-bit"),
    ({"quant_method": "gptq", "bits": 4}, "GPTQ"),
    ({"quant_method": "something-new"}, "something-new"),
    ({}, None),
])
def test_storage_methods_are_named_as_users_know_them(config, name):
    assert storage_method(config) == name


def test_the_storage_room_imports_nothing_above_it():
    """convert/stored/ is below the checkpoint reader: it imports only itself and convert's errors."""
    for path in STORED.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 or node.module == "errors", f"{path.name} imports ..{node.module}"
