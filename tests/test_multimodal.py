"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration): text-only targets export the text model
(parity in tests/test_gguf_export.py and tests/test_mlx_export.py, parametrized from the support matrix); here:
the vision tower is left out with a note, an adapter that changes it is refused; merge keeps the whole model, an
adapter on both towers merged exactly (PEFT's logits with an image in the prompt); the targets that would have to
keep it and cannot prove it refuse the checkpoint with the reason — exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def vision_adapter(zoo, tmp_path_factory):
    """LoRA on q_proj of both towers."""

    out = tmp_path_factory.mktemp("mm") / "vision-lora"
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo.base("gemma3"), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=r".*(vision_tower|language_model).*\.(q_proj|fc1)",
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def test_merge_keeps_the_vision_tower_and_equals_peft_on_images(zoo, tmp_path, cli, vision_adapter):
    """LoRA on both towers merged into the whole checkpoint (the hub's names kept): with an image in the prompt,
    transformers on the merged directory = PEFT unmerged."""
    from transformers import AutoModelForCausalLM

    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.toolkit.fidelity import load_peft

    base, out = zoo.base("gemma3"), tmp_path / "merged"
    code, _, err = cli("merge", "--base", base, "--adapter", vision_adapter, "--out", out)
    assert code == 0, err
    assert sorted(Checkpoint(out).names()) == sorted(Checkpoint(base).names())  # vision tower and layout kept
    cfg = json.loads((base / "config.json").read_text())
    image = cfg["image_token_index"]
    ids = torch.tensor([[2, 50, cfg["boi_token_index"], *[image] * cfg["mm_tokens_per_image"],
                         cfg["eoi_token_index"], 60, 70, 80]])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    peft = load_peft(base, vision_adapter)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        got, want, plain = (m(input_ids=ids, pixel_values=pixels).logits for m in (merged, peft, base_model))
    assert (got - want).abs().max().item() <= 1e-4
    assert (want - plain).abs().max().item() > 0.1
    vision_q = next(n for n in Checkpoint(base).names()
                    if n.startswith("vision_tower.") and n.endswith("q_proj.weight"))
    assert not torch.equal(Checkpoint(out).read(vision_q), Checkpoint(base).read(vision_q))  # the vision LoRA merged


def test_text_model_exported_and_vision_tower_left_out_with_a_note(zoo, tmp_path, cli):
    code, out, err = cli("export", "--target", "gguf", "--json", "--base", zoo.base("gemma3"), "--quant", "f32",
                         "--adapters", "separate", "--adapter", f"a={zoo.adapter('gemma3', 'all_linear')}",
                         "--out", tmp_path / "gguf")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("vision-tower tensors left out" in n for n in notes), notes


def test_adapter_on_the_vision_tower_is_refused_for_text_only_targets(zoo, tmp_path, cli, vision_adapter):
    for target in ("gguf", "mlx"):
        out = tmp_path / target
        code, _, err = cli("export", "--target", target, "--base", zoo.base("gemma3"), "--adapter", vision_adapter,
                           "--out", out)
        assert code == 2 and "changes the vision tower" in err and "Traceback" not in err, err
        assert not out.exists()


@pytest.mark.parametrize("target", ["vllm", "awq", "exl3"])
def test_targets_that_keep_the_vision_tower_refuse_with_the_reason(zoo, tmp_path, cli, target):
    out = tmp_path / "out"
    code, _, err = cli("export", "--target", target, "--base", zoo.base("gemma3"), "--out", out)
    assert code == 2 and not out.exists(), err
    assert "does not export multimodal gemma3" in err or "CUDA" in err, err  # exl3 asks for CUDA first
    if target == "vllm":
        assert "torchvision" in err, err
