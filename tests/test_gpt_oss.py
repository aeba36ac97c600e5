"""gpt-oss as it is released and as Unsloth merges it: the experts in MXFP4 (``_blocks`` / ``_scales``), everything
else 16-bit, YaRN untruncated. Built from Unsloth's real gpt-oss-20b config (tests/real), shrunk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tuneport.convert.checkpoint import Checkpoint
from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, logits

REAL = Path(__file__).parent / "real" / "tools" / "unsloth--gpt-oss-20b-merged" / "config.json"
IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]
ACCEPT = ("--accept-config-key", "rope_parameters")  # YaRN truncate: false (tests/test_real_configs.py)


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory) -> Path:
    from tuneport.toolkit.tiny.real import make_base_like

    return make_base_like(json.loads(REAL.read_text()), tmp_path_factory.mktemp("gpt-oss") / "base")


def test_mxfp4_experts_read_as_transformers_dequantizes_them(mxfp4_base):
    """Each expert's gate, up and down projection and bias, served from the fused MXFP4 blocks (gate and up rows
    interleaved), equals transformers' own dequantized parameters; the checkpoint then reads as unquantized."""
    stored = json.loads((mxfp4_base / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored and not any(
        n.endswith("experts.gate_up_proj") for n in stored)
    ckpt = Checkpoint(mxfp4_base)
    assert ckpt.quantization is None and ckpt.stored_quantization["quant_method"] == "mxfp4"
    assert any("MXFP4" in n for n in ckpt.notes)
    experts = load_hf(mxfp4_base).model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, in, out], interleaved
    for e in range(gate_up.shape[0]):
        read = {p: ckpt.read(f"model.layers.1.mlp.experts.{e}.{p}.weight").float()
                for p in ("gate_proj", "up_proj", "down_proj")}
        assert torch.equal(read["gate_proj"], gate_up[e][:, 0::2].T)
        assert torch.equal(read["up_proj"], gate_up[e][:, 1::2].T)
        assert torch.equal(read["down_proj"], down[e].T)
        assert torch.equal(ckpt.read(f"model.layers.1.mlp.experts.{e}.up_proj.bias").float(),
                           experts.gate_up_proj_bias.detach()[e][1::2])


def test_merged_mxfp4_base_is_written_fused_and_unquantized(mxfp4_base, tmp_path, cli):
    """``tuneport merge`` of an MXFP4 base with a LoRA on its experts (PEFT's target_parameters) writes gpt-oss's
    fused layout (what transformers, vLLM and llama.cpp's converter read) in 16 bits, without the
    quantization_config, and equals PEFT (in fp32: ``--dtype auto`` keeps the experts in the bfloat16 they decode to,
    as PEFT's own merge over the dequantized model does)."""
    from tuneport.toolkit.fidelity import load_peft
    from tuneport.toolkit.tiny.adapters import make_adapter

    adapter = make_adapter(mxfp4_base, "experts", tmp_path / "adapter")
    code, _, err = cli("merge", "--base", mxfp4_base, "--adapter", adapter, "--out", tmp_path / "m", "--dtype", "fp32")
    assert code == 0, err
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "quantization_config" not in cfg
    merged = Checkpoint(tmp_path / "m")
    stored = {n for f in merged._files.values() for n in f.tensors}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored and not any(n.endswith("_blocks") for n in stored)
    ids = torch.tensor([IDS])
    cmp = compare_logits(logits(load_peft(mxfp4_base, adapter), ids)[0], logits(load_hf(tmp_path / "m"), ids)[0])
    assert cmp.max_abs <= 1e-4, cmp


@pytest.mark.llamacpp
def test_mxfp4_moe_gguf_keeps_the_experts_exactly_as_llamacpp_quantizes(mxfp4_base, tmp_path, cli):
    """--quant mxfp4_moe (llama.cpp's MXFP4_MOE: experts MXFP4, other matrices Q8_0) from an MXFP4 base: the expert
    tensors hold the checkpoint's values exactly, and the file computes what llama.cpp's own quantizer writes from
    the F32 GGUF."""
    import gguf

    from tuneport.convert.gguf.quant_types import QUANT_TYPES
    from tuneport.convert.gguf.quantize import quantize_with_llamacpp

    out = tmp_path / "gguf"
    code, _, err = cli("export", "--target", "gguf", "--base", mxfp4_base, "--quant", "f32,mxfp4_moe", "--out", out,
                       *ACCEPT)
    assert code == 0, err
    ours = out / f"{mxfp4_base.name}-MXFP4_MOE.gguf"
    reader = gguf.GGUFReader(str(ours))
    assert int(reader.get_field("general.file_type").contents()) == 38
    tensors = {t.name: t for t in reader.tensors}
    ckpt = Checkpoint(mxfp4_base)
    for gname, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        t = tensors[f"blk.1.ffn_{gname}_exps.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
        want = np.stack([ckpt.read(f"model.layers.1.mlp.experts.{e}.{proj}.weight").float().numpy()
                         for e in range(4)])
        assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape), want)
    assert tensors["blk.1.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    theirs = tmp_path / "llamacpp.gguf"
    quantize_with_llamacpp(out / f"{mxfp4_base.name}-F32.gguf", theirs, QUANT_TYPES["mxfp4_moe"])
    got = []
    for path in (ours, theirs):
        llm = llamacpp_model(path)
        try:
            got.append(torch.as_tensor(llamacpp_logits(llm, IDS)))
        finally:
            llm.close()
    assert torch.equal(got[0], got[1])
    cmp = compare_logits(logits(load_hf(mxfp4_base), torch.tensor([IDS]))[0], got[0])
    print(f"\ngpt-oss MXFP4_MOE: KL {cmp.kl:.2e}, top-1 {cmp.top1:.2f}")
    assert cmp.kl < 0.05


@pytest.mark.parametrize("target", ["gguf", "mlx"])
def test_untruncated_yarn_is_refused_with_the_flag_that_accepts_it(mxfp4_base, tmp_path, cli, target):
    """llama.cpp and mlx-lm round YaRN's correction range (transformers' truncate: true); gpt-oss trained with
    truncate: false: refused (exit 2, one line, nothing written), naming the difference and the flag."""
    out = tmp_path / target
    code, _, err = cli("export", "--target", target, "--base", mxfp4_base, "--out", out,
                       *(["--quant", "f32"] if target == "gguf" else []))
    assert code == 2 and not out.exists() and len(err.strip().splitlines()) == 1, err
    assert "YaRN with truncate: false" in err and "--accept-config-key rope" in err, err
