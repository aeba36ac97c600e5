"""Mixture-of-experts adapters that do not fit their base: refused with the reason (exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tuneport.convert.arch import ARCHS
from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.experts import disk_shapes
from tuneport.convert.safetensors_file import SafetensorsFile

MOE = ["mixtral", "qwen3_moe"]


def test_expert_lora_on_another_moe_base_is_refused(zoo, cli, tmp_path):
    """Mixtral's expert LoRA (4 experts of 256) over Qwen3-MoE (4 experts of 64): no expert fits it."""
    out = tmp_path / "out"
    code, _, err = cli("merge", "--base", zoo.base("qwen3_moe"), "--adapter", zoo.adapter("mixtral", "experts"),
                       "--out", out)
    assert code == 2 and not out.exists(), err
    assert "fits none of the base's 4 experts" in err and "Traceback" not in err, err


def test_expert_lora_on_a_dense_base_is_refused(zoo, cli, tmp_path):
    lora = tmp_path / "lora"
    shutil.copytree(zoo.adapter("llama", "plain"), lora)
    cfg = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": ["mlp.experts.down_proj"]}))
    sd = load_file(lora / "adapter_model.safetensors")
    sd["base_model.model.model.layers.0.mlp.experts.lora_A.weight"] = torch.zeros(32, 256)
    sd["base_model.model.model.layers.0.mlp.experts.lora_B.weight"] = torch.zeros(128, 32)
    save_file(sd, lora / "adapter_model.safetensors")
    code, _, err = cli("merge", "--base", zoo.base("llama"), "--adapter", lora, "--out", tmp_path / "out")
    assert code == 2 and "LoRA on raw parameters (mlp.experts.down_proj)" in err and "llama" in err, err
    assert not (tmp_path / "out").exists()


def test_an_expert_count_that_disagrees_with_the_weights_is_refused_for_gguf(zoo, cli, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(zoo.base("mixtral"), base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 5}))
    out = tmp_path / "out"
    code, _, err = cli("export", "--base", base, "--target", "gguf", "--quant", "f32", "--out", out)
    assert code == 2 and "counts 5 experts" in err and not out.exists(), err


def test_disk_shapes_split_the_fused_experts():
    mlp = "model.layers.0.mlp"
    memory = {f"{mlp}.experts.gate_up_proj": (2, 6, 4), f"{mlp}.experts.down_proj": (2, 4, 3),
              f"{mlp}.gate.weight": (2, 4), "model.layers.0.self_attn.q_proj.weight": (4, 4)}
    disk = disk_shapes(ARCHS["mixtral"], memory)
    moe = "model.layers.0.block_sparse_moe"
    want = {f"{moe}.experts.{e}.{w}.weight": (3, 4) for e in (0, 1) for w in ("w1", "w3")}
    want.update({f"{moe}.experts.{e}.w2.weight": (4, 3) for e in (0, 1)})
    want.update({f"{moe}.gate.weight": (2, 4), "model.layers.0.self_attn.q_proj.weight": (4, 4)})
    assert disk == want
    assert disk_shapes(ARCHS["llama"], memory) is memory


def _to_old_peft_layout(adapter, out):
    """The same fused-expert LoRA as PEFT before 0.19.1 saved it: A and B in the expert parameter's own order,
    delta_e = (B_e A_e)ᵀ (A' = B_eᵀ, B' = A_eᵀ), peft_version 0.18.0."""
    shutil.copytree(adapter, out)
    sd = load_file(out / "adapter_model.safetensors")
    cfg = json.loads((out / "adapter_config.json").read_text())
    n = 4  # the tiny MoE models' experts
    for key in [k for k in sd if ".experts." in k and k.endswith("lora_A.weight")]:
        a, b = sd[key], sd[key.replace("lora_A", "lora_B")]
        r = a.shape[0] // n
        a3, b3 = a.reshape(n, r, a.shape[1]), b.reshape(b.shape[0], r, n)
        sd[key] = torch.stack([b3[:, :, e].T for e in range(n)]).reshape(n * r, b.shape[0])
        sd[key.replace("lora_A", "lora_B")] = torch.stack([a3[e].T for e in range(n)], dim=-1).reshape(
            a.shape[1], r * n)
    save_file(sd, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "peft_version": "0.18.0"}))
    return out


def test_old_peft_expert_layout_merges_like_the_current_one(zoo, cli, tmp_path, ids):
    """PEFT before 0.19.1 stored fused-expert LoRA transposed; told by peft_version, it merges to the same model.
    Without a peft_version, square expert shapes (Qwen3-MoE's gate_up_proj here) are refused, not guessed."""
    from tuneport.toolkit.fidelity import load_hf, load_peft, logits

    base, adapter = zoo.base("qwen3_moe"), zoo.adapter("qwen3_moe", "experts")
    old = _to_old_peft_layout(adapter, tmp_path / "old")
    code, _, err = cli("merge", "--base", base, "--adapter", old, "--out", tmp_path / "merged")
    assert code == 0, err
    want = logits(load_peft(base, adapter), ids)
    assert (logits(load_hf(tmp_path / "merged"), ids) - want).abs().max().item() <= 1e-4
    cfg = json.loads((old / "adapter_config.json").read_text())
    del cfg["peft_version"]
    (old / "adapter_config.json").write_text(json.dumps(cfg))
    code, _, err = cli("merge", "--base", base, "--adapter", old, "--out", tmp_path / "guessed")
    assert code == 2 and "cannot be told from its square shapes" in err and not (tmp_path / "guessed").exists(), err


def test_inspect_counts_expert_lora(zoo):
    """inspect on a fused-expert adapter alone: its target_parameters and their LoRA parameters are counted."""
    from tuneport.convert.adapter import load_adapter
    from tuneport.toolkit.inspect import inspect_adapter

    path = zoo.adapter("qwen3_moe", "experts")
    report = inspect_adapter(path)
    assert report["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    attention = sum(m.A.numel() + m.B.numel() for m in load_adapter(path).modules.values())
    assert report["parameters"] > attention and set(report["targets"]) == {"q_proj", "v_proj"}
    assert "GPU (Triton) kernels only" in report["engines"]["vllm"]["reason"]


# -- checkpoints that store the experts fused (transformers 5's in-memory layout, saved as is) ------------------

@pytest.mark.parametrize("arch", MOE)
def test_fused_experts_on_disk_read_as_the_per_expert_tensors(zoo, arch):
    """Every per-expert tensor (and Mixtral's router under block_sparse_moe) is served from its rows of the fused
    tensor, bit for bit what the per-expert checkpoint stores; and transformers runs both alike."""
    from tuneport.toolkit.fidelity import load_hf, logits

    fused, split = Checkpoint(zoo.fused_base(arch)), Checkpoint(zoo.base(arch))
    stored = SafetensorsFile(fused.path / "model.safetensors").tensors
    assert len(stored["model.layers.0.mlp.experts.gate_up_proj"].shape) == 3
    assert sorted(fused.names()) == sorted(split.names())
    for name in split.names():
        assert fused.meta(name).shape == split.meta(name).shape, name
        assert torch.equal(fused.read(name), split.read(name)), name
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 3]])
    assert torch.equal(logits(load_hf(fused.path), ids), logits(load_hf(split.path), ids))


@pytest.mark.parametrize("arch", MOE)
def test_a_fused_base_merges_like_the_per_expert_one(zoo, cli, tmp_path, arch):
    """The expert LoRA merged over the fused checkpoint gives the same tensors as over the per-expert one."""
    for name, base in (("fused", zoo.fused_base(arch)), ("split", zoo.base(arch))):
        code, _, err = cli("merge", "--base", base, "--adapter", zoo.adapter(arch, "all_linear"),
                           "--out", tmp_path / name)
        assert code == 0, err
    fused, split = Checkpoint(tmp_path / "fused"), Checkpoint(tmp_path / "split")
    assert sorted(fused.names()) == sorted(split.names())
    for name in split.names():
        assert torch.equal(fused.read(name), split.read(name)), name


def test_mlx_export_of_a_fused_base_is_that_of_the_per_expert_one(zoo, cli, tmp_path):
    for name, base in (("fused", zoo.fused_base("qwen3_moe")), ("split", zoo.base("qwen3_moe"))):
        code, _, err = cli("export", "--target", "mlx", "--base", base, "--quant", "q4", "--out", tmp_path / name)
        assert code == 0, err
    fused, split = (load_file(tmp_path / n / "model.safetensors") for n in ("fused", "split"))
    assert fused.keys() == split.keys() and all(torch.equal(fused[k], split[k]) for k in split)


@pytest.mark.llamacpp
@pytest.mark.slow
def test_gguf_of_a_fused_base_is_that_of_the_per_expert_one(zoo, cli, tmp_path):
    import gguf

    for name, base in (("fused", zoo.fused_base("mixtral")), ("split", zoo.base("mixtral"))):
        code, _, err = cli("export", "--target", "gguf", "--base", base, "--quant", "f32", "--out", tmp_path / name)
        assert code == 0, err
    fused, split = (gguf.GGUFReader(str(next((tmp_path / n).glob("*.gguf")))) for n in ("fused", "split"))
    theirs = {t.name: t for t in split.tensors}
    assert sorted(t.name for t in fused.tensors) == sorted(theirs)  # in storage order, which differs
    for t in fused.tensors:
        assert t.tensor_type == theirs[t.name].tensor_type and t.data.tobytes() == theirs[t.name].data.tobytes(), t.name


def test_experts_stored_both_fused_and_per_expert_are_refused(zoo, cli, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(zoo.fused_base("qwen3_moe"), base)
    save_file({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(64, 64)}, base / "extra.safetensors")
    code, _, err = cli("merge", "--base", base, "--adapter", zoo.adapter("qwen3_moe", "plain"),
                       "--out", tmp_path / "out")
    assert code == 2 and "stored both per expert and fused" in err and not (tmp_path / "out").exists(), err


def test_a_saved_router_merges_under_its_disk_name(zoo, tmp_path, ids):
    """modules_to_save=["gate"] on Mixtral (a fully trained router): PEFT saves it as mlp.gate, the checkpoint
    stores block_sparse_moe.gate; merged = PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import tuneport
    from tuneport.toolkit.fidelity import load_hf, load_peft, logits

    base = zoo.base("mixtral")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                  modules_to_save=["gate"]))
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    peft_model.save_pretrained(tmp_path / "lora")
    saved = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert any(".mlp.gate." in k for k in saved), list(saved)
    tuneport.merge(base=base, adapters=[tmp_path / "lora"], out=tmp_path / "merged")
    want = logits(load_peft(base, tmp_path / "lora"), ids)
    assert (logits(load_hf(tmp_path / "merged"), ids) - want).abs().max().item() <= 1e-4
    assert (want - logits(load_hf(base), ids)).abs().max().item() > 0.1
