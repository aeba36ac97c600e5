"""PEFT adapters rewritten for exllamav3's run-time LoRA loader (convert/exl3/adapter.py), checked on CPU.

exllamav3's ``LoRA`` (exllamav3/model/lora.py, 1.6.x) scales every module by the config's ``lora_alpha / r`` (or
``/ sqrt(r)`` with ``use_rslora``), ignores ``rank_pattern`` / ``alpha_pattern``, and matches modules by name against
its own (split) linears. The rewritten adapter must give PEFT's numbers under that rule: checked here with PEFT itself
(logits) and with the loader's rule written out independently (per-module deltas).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_real_adapters import ADAPTERS, _real_adapter, _tiny_base

from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.errors import UserError
from tuneport.convert.exl3.adapter import MERGE_HINT, cached_exl3_adapter
from tuneport.convert.exl3.read import FUSED_PARTS, Exl3Model, part_rows
from tuneport.toolkit.fidelity import load_peft, logits

IDS = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]])


def exl3_layout(src: Path, out: Path) -> Path:
    """``src``'s linears in the EXL3 directory layout (trellis/suh/svh with exllamav3's shapes, zero codes; fused
    linears split as exllamav3 stores them): all the rewriter reads of an EXL3 model is its names and shapes."""
    ck = Checkpoint(src)
    pad = lambda n: -(-n // 128) * 128  # noqa: E731
    tensors = {}
    for name in ck.names():
        shape = ck.meta(name).shape
        key, leaf = name.removesuffix(".weight"), name.removesuffix(".weight").rsplit(".", 1)[-1]
        if not name.endswith(".weight") or len(shape) != 2 or "embed" in name:
            tensors[name] = ck.read(name).half()
            continue
        parts = part_rows(ck.config, leaf) if leaf in FUSED_PARTS else [(leaf, shape[0])]
        for part, rows in parts:
            k = f"{key.rsplit('.', 1)[0]}.{part}" if "." in key else part
            tensors[f"{k}.trellis"] = torch.zeros(pad(shape[1]) // 16, pad(rows) // 16, 64, dtype=torch.int16)
            tensors[f"{k}.suh"], tensors[f"{k}.svh"] = torch.ones(pad(shape[1])).half(), torch.ones(pad(rows)).half()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {**ck.config, "quantization_config": {"quant_method": "exl3", "bits": 4, "head_bits": 6}}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def llama_exl3(zoo, tmp_path_factory):
    return Exl3Model(exl3_layout(zoo.base("llama"), tmp_path_factory.mktemp("exl3") / "llama"))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))


def loader_deltas(adapter: Path) -> dict[str, torch.Tensor]:
    """exllamav3's loader rule, written out: one scale from r / lora_alpha / use_rslora, patterns ignored,
    delta W = scale · B @ A per module."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r, alpha = cfg["r"], float(cfg["lora_alpha"])
    scale = (alpha * math.sqrt(r) if cfg.get("use_rslora") else alpha) / r
    t = load_file(str(adapter / "adapter_model.safetensors"))
    return {k.split(".lora_A.")[0].removeprefix("base_model.model."):
            scale * t[k.replace(".lora_A.", ".lora_B.")].float() @ v.float() for k, v in t.items() if ".lora_A." in k}


def peft_deltas(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """PEFT's own delta W of every adapted linear (its scaling: patterns, rsLoRA)."""
    model = load_peft(base, adapter)
    return {name.removeprefix("base_model.model."): m.get_delta_weight("default").float()
            for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and "default" in m.lora_A}


@pytest.mark.parametrize("variant", ["patterns", "rslora"])
def test_rewritten_adapter_gives_peft_logits(variant, zoo, llama_exl3):
    base, original = zoo.base("llama"), zoo.adapter("llama", variant)
    rewritten, lora = cached_exl3_adapter(original, llama_exl3)
    with torch.no_grad():
        ref, got = logits(load_peft(base, original), IDS), logits(load_peft(base, rewritten), IDS)
    assert (ref - got).abs().max().item() <= 1e-5
    assert (ref - logits(load_peft(base, zoo.adapter("llama", "plain")), IDS)).abs().max() > 1e-2  # not vacuous
    assert cached_exl3_adapter(original, llama_exl3)[0] == rewritten  # cached by content
    if variant == "patterns":
        assert any("padded with zeros to 12" in n for n in lora.notes), lora.notes


@pytest.mark.parametrize("variant", ["patterns", "rslora"])
def test_rewritten_config_has_scale_one_for_a_loader_that_ignores_patterns(variant, zoo, llama_exl3):
    """exllamav3 reads only r, lora_alpha, use_rslora: on the rewritten adapter its rule gives PEFT's deltas; on
    the original with patterns it would not (the reason for the rewrite)."""
    base, original = zoo.base("llama"), zoo.adapter("llama", variant)
    rewritten, _ = cached_exl3_adapter(original, llama_exl3)
    cfg = json.loads((rewritten / "adapter_config.json").read_text())
    assert cfg["r"] == cfg["lora_alpha"] and not cfg["use_rslora"] and not cfg["fan_in_fan_out"]
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    want, got = peft_deltas(base, original), loader_deltas(rewritten)
    assert set(got) == set(want)
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6
    naive = loader_deltas(original)  # patterns ignored: wrong; rsLoRA alone exllamav3 scales right itself
    worst = max((want[k] - naive[k]).abs().max().item() for k in want if naive[k].shape == want[k].shape)
    assert worst > 1e-3 if variant == "patterns" else worst <= 1e-6


def test_phi3_fused_lora_splits_into_exllamav3s_parts(zoo, tmp_path):
    """Unsloth's real Phi-3 config (LoRA on fused qkv_proj and o_proj) and PEFT's all-linear (gate_up_proj too):
    each split part's B @ A equals the rows of PEFT's fused delta that exllamav3 splits off."""
    real = ADAPTERS["unsloth--phi-3-mini-fused-qkv"]
    base = _tiny_base("phi3", json.loads(real.read_text()), tmp_path)
    exl3 = Exl3Model(exl3_layout(base, tmp_path / "exl3"))
    for adapter in (_real_adapter(base, real, tmp_path / "real"), zoo.adapter("phi3", "all_linear")):
        peft_base = base if adapter.parent.parent == tmp_path else zoo.base("phi3")
        rewritten, lora = cached_exl3_adapter(adapter, exl3)
        want, got = peft_deltas(peft_base, adapter), loader_deltas(rewritten)
        fused = [k for k in want if k.rsplit(".", 1)[-1] in FUSED_PARTS]
        assert fused and not set(fused) & set(got)
        for key in fused:
            parent, leaf = key.rsplit(".", 1)
            parts = part_rows(exl3.ckpt.config, leaf)
            rows = want[key].split([n for _, n in parts])
            for (part, _), expect in zip(parts, rows, strict=True):
                assert (got[f"{parent}.{part}"] - expect).abs().max().item() <= 1e-6, (key, part)
        assert any("split into q_proj, k_proj, v_proj" in n for n in lora.notes)
        assert all(k in got and (got[k] - want[k]).abs().max() <= 1e-6 for k in want if k not in fused)


@pytest.mark.parametrize(("variant", "why"), [
    ("dora", "DoRA (use_dora): exllamav3 applies no magnitude vector"),
    ("embedding", "LoRA on embeddings (model.embed_tokens)"),
    ("modules_to_save", "modules_to_save (lm_head.weight, model.embed_tokens.weight)"),
])
def test_what_exllamav3_cannot_apply_is_refused(variant, why, zoo, llama_exl3):
    with pytest.raises(UserError) as e:
        cached_exl3_adapter(zoo.adapter("llama", variant), llama_exl3)
    assert "exllamav3 cannot apply adapter" in e.value.message and why in e.value.message, e.value.message
    assert e.value.hint == MERGE_HINT == "merge it: tuneport export --target exl3 --adapter PATH"


def test_an_adapter_of_another_model_is_refused(zoo, llama_exl3, tmp_path):
    """Every module must be one of the EXL3 model's linears and fit it: exllamav3 would skip it silently."""
    with pytest.raises(UserError, match=r"does not fit llama: model.layers.0.self_attn.q_proj is \[256, 256\], the "
                       r"model's \[128, 128\] \(padded\)") as e:
        cached_exl3_adapter(zoo.adapter("llama", "plain", wide=True), llama_exl3)
    assert "serve it with its own base" in e.value.hint
