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


def _with_mtp_head(base: Path, out: Path) -> Path:
    """``base`` with a multi-token-prediction head beside it, as the hub's checkpoints store one (``mtp.*``, which
    transformers loads past)."""
    from safetensors.torch import save_file

    shutil.copytree(base, out)
    head = {"mtp.fc.weight": torch.randn(128, 256), "mtp.norm.weight": torch.ones(128),
            "mtp.layers.0.input_layernorm.weight": torch.ones(128)}
    save_file(head, out / "mtp.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(head, "mtp.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.mark.llamacpp
def test_a_released_checkpoints_mtp_head_is_kept_by_merge_and_left_out_of_the_gguf(zoo, tmp_path, cli):
    """Merge keeps mtp.* (the load check passes it as transformers does) and equals PEFT; the GGUF of the text model
    leaves it out and equals transformers."""
    from safetensors import safe_open

    base = _with_mtp_head(zoo.base("qwen3_5"), tmp_path / "base")
    adapter = zoo.adapter("qwen3_5", "all_linear")
    code, _, err = cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "merged")
    assert code == 0, err
    stored = set()
    for f in (tmp_path / "merged").glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            stored |= set(s.keys())
    assert {"mtp.fc.weight", "mtp.norm.weight"} <= stored
    want = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    assert compare_logits(want, logits(load_hf(tmp_path / "merged"), torch.tensor([IDS]))[0]).max_abs <= 1e-4
    code, _, err = cli("export", "--target", "gguf", "--base", base, "--quant", "f32", "--out", tmp_path / "gguf")
    assert code == 0, err
    llm = llamacpp_model(tmp_path / "gguf" / "base-F32.gguf")
    try:
        got = compare_logits(logits(load_hf(base), torch.tensor([IDS]))[0], llamacpp_logits(llm, IDS))
    finally:
        llm.close()
    assert got.max_abs <= 1e-4, got


def test_a_quantized_mlx_export_reads_back_as_its_text_model(zoo, tmp_path, cli):
    """mlx-lm knows the text model as qwen3_5_moe and keys per-module quantization by its own tree
    (language_model.*): tuneport reads the directory back as qwen3_5_moe_text with the router's 8 bits."""
    pytest.importorskip("mlx_lm")
    from tuneport.convert.checkpoint import Checkpoint

    out = tmp_path / "mlx"
    code, _, err = cli("export", "--target", "mlx", "--base", zoo.base("qwen3_5_moe_text"), "--quant", "q4",
                       "--out", out)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["quantization"]["language_model.model.layers.0.mlp.gate"][
        "bits"] == 8
    ckpt = Checkpoint(out)
    assert ckpt.model_type == "qwen3_5_moe_text"
    assert ckpt.weight_shape("model.layers.0.mlp.gate.weight") == (4, 128)  # 4 experts over hidden 128, unpacked
    code, stdout, err = cli("inspect", out, "--json")
    assert code == 0 and json.loads(stdout)["architecture"] == "qwen3_5_moe_text", err
