"""Real ``adapter_config.json`` files as Unsloth, TRL, Axolotl, LLaMA-Factory, PEFT and mlx-lm save them
(tests/real/tools/, sources in its README): each is read by tuneport as it is, and either

- applied: a PEFT adapter made with that very config (PEFT reads the file) over a tiny base of the architecture the
  file names, saved, and the real file put back in place: tuneport's merge = PEFT and its GGUF LoRA in llama.cpp =
  PEFT (max |Δlogit| <= 1e-4); an adapter trained over a 4-bit base (Unsloth's ``-bnb-4bit``) says which 16-bit
  base to pass, in ``inspect`` and in the export's notes;
- or refused, with the reason the test asserts: a file that is not PEFT's, or an architecture tuneport's table
  does not have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tuneport.convert.adapter_config import config_refusals, unquantized_name
from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, load_peft, logits

REAL = Path(__file__).parent / "real" / "tools"
ADAPTERS = {p.parent.name: p for p in sorted(REAL.glob("*/adapter_config.json"))}
IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]

# The tiny architecture each adapter's base is (by the base it names; Unsloth's Phi-3.5 is stored as Llama)
ARCH = {
    "axolotl--llama2-7b-qlora": "llama", "axolotl--open-llama-3b-lora": "llama", "axolotl--tinyllama-lora": "llama",
    "llamafactory--llama3-8b-lora-sft": "llama", "unsloth--llama-3.1-8b-dup-targets": "llama",
    "unsloth--llama-3.1-8b-lora": "llama", "unsloth--llama-3.2-1b-peft018-lora": "llama",
    "unsloth--phi-3.5-mini-lora": "llama", "peft--mistral-7b-heretic-r1": "mistral",
    "peft--mistral-7b-r256-old": "mistral", "peft--qwen3-0.6b-windows-path-peft021": "qwen3",
    "trl--qwen2.5-0.5b-dpo-peft020": "qwen2", "unsloth--qwen2.5-7b-grpo-lora": "qwen2",
    "trl--gemma-2-9b-qlora-partial-layers": "gemma2", "unsloth--gemma-2-9b-lora": "gemma2",
    "unsloth--gemma-3-1b-regex-targets": "gemma3_text", "unsloth--phi-3-mini-fused-qkv": "phi3",
    # Gemma 4 as released (multimodal), the adapters trained on the text model AutoModelForCausalLM loads from it
    "peft--gemma-4-e4b-exclude-regex-peft019": "gemma4", "unsloth--gemma-4-e2b-lora": "gemma4",
}
# Adapters of architectures tuneport's table does not have (their bases are refused by every target)
OTHER_ARCH = {
    "peft--gpt2-fan-in-fan-out-null-task": "GPT-2",
    "peft--nemotron-3-nano-minimal-handwritten": "Nemotron 3 (hybrid Mamba)", "peft--phi-1.5-legacy-wqkv": "phi-1.5",
    "trl--phi-2-qlora": "phi-2", "unsloth--gemma-3n-e4b-lora": "Gemma 3n",
}
# Adapters of a multimodal base that train its vision tower too: merged whole; text-only targets name the vision part
GEMMA_TOL = 2e-2
MULTIMODAL = {"llamafactory--qwen3.5-9b-vl-local-lora": "qwen3_5"}
NOT_PEFT = {  # file -> a piece of its one refusal
    "mlx-lm--llama-3-8b-old-lora-keys": "mlx-lm's (mlx_lm.lora", "mlx-lm--llama-3.2-1b-lora": "mlx-lm's (mlx_lm.lora",
    "mlx-lm--qwen1.5-32b-old-all-layers": "mlx-lm's (mlx_lm.lora",
    "mlx-lm--qwen3-1.7b-local-4bit-lora": "mlx-lm's (mlx_lm.lora",
    "peft--not-peft-jax-tunix-gemma3": "neither peft_type nor r: it is not a PEFT LoRA adapter",
}


def test_every_real_adapter_file_is_classified():
    assert set(ADAPTERS) == set(ARCH) | set(OTHER_ARCH) | set(NOT_PEFT) | set(MULTIMODAL)


@pytest.mark.parametrize("name", sorted(NOT_PEFT))
def test_a_file_that_is_not_peft_is_refused_with_one_reason(name, cli, zoo, tmp_path):
    cfg = json.loads(ADAPTERS[name].read_text())
    reasons = config_refusals(cfg)
    assert len(reasons) == 1 and NOT_PEFT[name] in reasons[0], reasons
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(ADAPTERS[name].read_text())
    out = tmp_path / "merged"
    code, _, err = cli("merge", "--base", zoo.base("llama"), "--adapter", tmp_path / "a", "--out", out)
    assert code == 2 and NOT_PEFT[name] in err and len(err.strip().splitlines()) == 1 and not out.exists(), err


def _tiny_base(arch: str, cfg: dict, root: Path) -> Path:
    from tuneport.toolkit.tiny import make_base

    layers = cfg.get("layers_to_transform")
    need = max(layers) + 1 if isinstance(layers, list) and layers else 2
    return make_base(arch, root / "base", dims={"num_hidden_layers": need} if need > 2 else None)


def _real_adapter(base: Path, real: Path, out: Path) -> Path:
    """A PEFT adapter made with the real config (as PEFT reads it), saved, the real file put back."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tuneport.toolkit.tiny.adapters import TOWERS, _randomize

    (out / "config").mkdir(parents=True)
    (out / "config" / "adapter_config.json").write_text(real.read_text())
    config = LoraConfig.from_pretrained(out / "config")
    config.base_model_name_or_path = str(base)
    config.inference_mode = False  # saved files say true, which freezes the LoRA and _randomize would leave B at 0
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if (towers := TOWERS.get(model.config.model_type)) and not config.exclude_modules:
        config.exclude_modules = towers  # PEFT cannot adapt Gemma 4's wrapped vision linears (Unsloth's LoRA can)
    model = get_peft_model(model, config)
    _randomize(model, 1)
    model.save_pretrained(out / "adapter")
    if config.exclude_modules != LoraConfig.from_pretrained(out / "config").exclude_modules:
        shutil.copytree(out / "adapter", out / "peft-readable")  # what PEFT itself can load as the reference
    (out / "adapter" / "adapter_config.json").write_text(real.read_text())  # the file as the tool wrote it
    return out / "adapter"


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("name", sorted(ARCH))
def test_a_real_adapter_config_merges_and_exports_like_peft(name, cli, tmp_path):
    real = ADAPTERS[name]
    cfg = json.loads(real.read_text())
    assert config_refusals(cfg) == []
    arch = ARCH[name]
    base = _tiny_base(arch, cfg, tmp_path)
    adapter = _real_adapter(base, real, tmp_path)
    ids = torch.tensor([IDS])
    readable = tmp_path / "peft-readable"  # PEFT cannot load Unsloth's Gemma 4 file itself (its vision linears)
    with torch.no_grad():
        ref = logits(load_peft(base, readable if readable.exists() else adapter), ids)[0]
    assert compare_logits(ref, logits(load_hf(base), ids)[0]).max_abs > 0.1  # the adapter does something
    code, stdout, err = cli("merge", "--base", base, "--adapter", f"a={adapter}", "--out", tmp_path / "merged",
                            "--json")
    assert code == 0, err
    assert compare_logits(ref, logits(load_hf(tmp_path / "merged"), ids)[0]).max_abs <= 1e-4
    notes = json.loads(stdout)["notes"]
    if (plain := unquantized_name(cfg.get("base_model_name_or_path"))) is not None:
        assert any(f"16-bit weights: {plain})" in n for n in notes), notes
        code, stdout, _ = cli("inspect", adapter, "--json")
        assert json.loads(stdout)["base_model_16bit"] == plain
    code, _, err = cli("export", "--target", "gguf", "--base", base, "--quant", "f32", "--adapters", "separate",
                       "--adapter", f"a={adapter}", "--out", tmp_path / "gguf")
    assert code == 0, err
    llm = llamacpp_model(next((tmp_path / "gguf").glob("*-F32.gguf")), tmp_path / "gguf" / "adapters" / "a-F32.gguf")
    try:
        separate = llamacpp_logits(llm, IDS)
    finally:
        llm.close()
    got = compare_logits(ref, separate)
    # Gemma: llama.cpp's fp16 GELU table moves logits, the more the larger the adapter moves activations (measured:
    # 5e-3 under the zoo's adapters, 1.9e-3 under Unsloth's real Gemma 3 adapter, 1.1e-2 under TRL's Gemma 2 one;
    # the GGUF LoRA and the merged GGUF differ by 8e-4 in the same llama.cpp, so the table, not the LoRA)
    assert got.max_abs <= (GEMMA_TOL if arch.startswith("gemma") else 1e-4), got


@pytest.mark.parametrize("name", sorted(OTHER_ARCH))
def test_an_adapter_of_an_architecture_outside_the_table_is_read_as_it_is(name):
    """Its keys are PEFT's and honoured (regex exclude_modules, fan_in_fan_out, a hand-written minimal file): it
    would apply; what stops it is its base, which every target refuses as an unsupported architecture."""
    assert config_refusals(json.loads(ADAPTERS[name].read_text())) == []


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_a_real_multimodal_adapter_merges_whole_and_text_targets_name_its_vision_modules(name, zoo, cli, tmp_path):
    """LLaMA-Factory's Qwen3.5 LoRA (text and GatedDeltaNet projections, and the vision tower's qkv / attn.proj /
    linear_fc1 / linear_fc2; task_type SEQ_2_SEQ_LM) made by PEFT from the file over the tiny multimodal base:
    tuneport's merge keeps the vision tower and equals PEFT; --target gguf refuses, naming a vision module (the text
    model's GGUF would answer images without that LoRA), and writes nothing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from tuneport.toolkit.tiny.adapters import _randomize

    real = ADAPTERS[name]
    base = zoo.base(MULTIMODAL[name])
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "adapter_config.json").write_text(real.read_text())
    config = LoraConfig.from_pretrained(tmp_path / "config")
    config.base_model_name_or_path = str(base)
    config.inference_mode = False  # the file says true, which freezes the LoRA (B would stay 0)
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), config)
    _randomize(model, 1)
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert any(".visual." in n for n in adapted) and any(".linear_attn.in_proj_qkv" in n for n in adapted)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ref = model.base_model(input_ids=ids).logits[0].float()  # past the SEQ_2_SEQ_LM wrapper PEFT picks
        assert compare_logits(ref, logits(load_hf(base), ids)[0]).max_abs > 0.1  # the adapter does something
    model.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").write_text(real.read_text())
    code, _, err = cli("merge", "--base", base, "--adapter", tmp_path / "adapter", "--out", tmp_path / "merged")
    assert code == 0, err
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = compare_logits(ref, merged(input_ids=ids).logits[0].float())
    assert got.max_abs <= 1e-4, got
    vision = {n: t for n, t in merged.state_dict().items() if ".visual." in n}
    base_vision = {n: t for n, t in AutoModelForImageTextToText.from_pretrained(base).state_dict().items()
                   if ".visual." in n}
    assert vision.keys() == base_vision.keys() and any(not torch.equal(vision[n], base_vision[n]) for n in vision)
    out = tmp_path / "gguf"
    code, _, err = cli("export", "--target", "gguf", "--base", base, "--quant", "f32", "--adapters", "separate",
                       "--adapter", f"a={tmp_path / 'adapter'}", "--out", out)
    assert code == 2 and "changes the vision tower (model.visual." in err and not out.exists(), err
