"""Qwen3.5 / 3.6 as users have it: the hub's multimodal checkpoint (``Qwen3_5ForConditionalGeneration``), and the
text model transformers 5 saves after AutoModelForCausalLM loaded it from there (Unsloth's and TRL's merged
fine-tunes): a ``qwen3_5_text`` config over tensors still named ``model.language_model.*``. Both export like
transformers (GGUF in llama.cpp, MLX in mlx-lm) and merge like PEFT; the parity tests of every target run the
tiny ``qwen3_5`` and ``qwen3_5_text`` bases (tests/test_gguf_export.py and the others, from the support matrix)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, load_peft, logits
from tuneport.toolkit.tiny.adapters import make_adapter

IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def resaved(zoo, tmp_path_factory) -> Path:
    """The tiny multimodal base loaded by AutoModelForCausalLM and saved again, as a merged fine-tune arrives."""
    from transformers import AutoModelForCausalLM

    base = zoo.base("qwen3_5")
    out = tmp_path_factory.mktemp("resaved") / "model"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).save_pretrained(out, max_shard_size="400KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            shutil.copy(base / f, out / f)
    return out


def test_the_resaved_text_model_keeps_its_parents_names(resaved):
    """What the tests below rely on: transformers 5.19 writes a qwen3_5_text config over model.language_model.*."""
    from tuneport.convert.checkpoint import Checkpoint

    cfg = json.loads((resaved / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and "text_config" not in cfg
    index = json.loads((resaved / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("model.language_model.layers.") for n in index)
    assert not any(n.startswith("model.layers.") for n in index)
    ckpt = Checkpoint(resaved)  # read under the text model's own names
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in ckpt and "model.embed_tokens.weight" in ckpt
    assert torch.equal(ckpt.read("model.norm.weight"), _stored(resaved, "model.language_model.norm.weight"))


def _stored(model: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(model / index[name]), "pt") as f:
        return f.get_tensor(name)


@pytest.mark.llamacpp
def test_the_resaved_text_model_exports_and_merges_like_transformers(resaved, tmp_path, cli):
    """GGUF F32 in llama.cpp, MLX in mlx-lm and a merged all-linear adapter: transformers' (PEFT's) logits."""
    from tuneport.toolkit.verify.mlx_runner import load_mlx, mlx_logits

    ref = logits(load_hf(resaved), torch.tensor([IDS]))[0]
    code, _, err = cli("export", "--target", "gguf", "--base", resaved, "--quant", "f32", "--out", tmp_path / "gguf")
    assert code == 0, err
    llm = llamacpp_model(tmp_path / "gguf" / f"{resaved.name}-F32.gguf")
    try:
        gguf = compare_logits(ref, llamacpp_logits(llm, IDS))
    finally:
        llm.close()
    assert gguf.max_abs <= 1e-4, gguf
    code, _, err = cli("export", "--target", "mlx", "--base", resaved, "--out", tmp_path / "mlx")
    assert code == 0, err
    mlx = compare_logits(ref, mlx_logits(load_mlx(tmp_path / "mlx")[0], IDS))
    assert mlx.max_abs <= 1e-4, mlx
    adapter = make_adapter(resaved, "all_linear", tmp_path / "adapter")
    want = logits(load_peft(resaved, adapter), torch.tensor([IDS]))[0]
    code, _, err = cli("merge", "--base", resaved, "--adapter", adapter, "--out", tmp_path / "merged")
    assert code == 0, err
    merged = compare_logits(want, logits(load_hf(tmp_path / "merged"), torch.tensor([IDS]))[0])
    assert merged.max_abs <= 1e-4 and compare_logits(want, ref).max_abs > 0.1, merged
