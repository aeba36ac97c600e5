"""``tuneport verify`` in llama.cpp: tuneport's own GGUF files and GGUF LoRA pass with the figures the export
tests assert; defects made on purpose fail their gate with a message that names the cause; the CLI's
JSON, exit codes 2 and 3; the reference is computed once."""

from __future__ import annotations

import json
import shutil

import pytest

import tuneport
from tuneport.toolkit.verify import Gate, VerifyOptions, verify

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def qwen(zoo, tmp_path_factory):
    """The tiny qwen2 (byte-level BPE, hidden 256 for K-quants), an rsLoRA adapter, and their GGUF export."""
    base, adapter = zoo.base("qwen2", wide=True), zoo.adapter("qwen2", "rslora", wide=True)
    out = tmp_path_factory.mktemp("verify") / "gguf"
    tuneport.export(base=base, adapters=[f"style={adapter}"], target="gguf", adapter_mode="separate",
                    quant="f32,q8_0,q4_k_m", out=out)
    return base, adapter, out, out / "adapters" / "style-F32.gguf"


def _failed(report) -> dict[str, dict]:
    return {g["gate"]: g for g in report.failures}


@pytest.mark.parametrize(("quant", "gates", "limits"), [
    ("F32", ["max_abs<=1e-3", "kl<=1e-8", "top1>=1", "greedy>=1"], {"max_abs": 1e-3, "strength_error": 1e-4}),
    ("Q8_0", ["kl<=0.02", "top1>=0.85"], {"strength_error": 0.02}),
    ("Q4_K_M", ["kl<=0.5", "strength_error<=0.25"], {"strength_error": 0.25}),
])
def test_own_gguf_and_lora_pass(qwen, quant, gates, limits):
    base, adapter, out, lora = qwen
    report = verify(artifact=out / f"{base.name}-{quant}.gguf", reference=base, adapter=adapter, lora=lora,
                    gates=gates)
    assert report.passed, report.failure_line()
    assert {c: report.checks[c]["passed"] for c in report.checks} == {
        "tokenizer": True, "chat_template": True, "special_tokens": True}
    for metric, limit in limits.items():
        assert report.metrics[metric] <= limit, (metric, report.metrics)
    assert {g["gate"] for g in report.gates} >= {"tokenizer", "chat_template", "special_tokens",
                                                  *(str(Gate.parse(g)) for g in gates)}


def test_base_model_alone_is_exact(qwen):
    base, _, out, _ = qwen
    report = verify(artifact=out / f"{base.name}-F32.gguf", reference=base, gates=["max_abs<=1e-4"])
    assert report.passed and report.metrics["strength"] is None
    assert report.metrics["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)


def test_changed_chat_template_is_caught(qwen, tmp_path):
    base, _, _, _ = qwen
    other = tmp_path / "base"
    shutil.copytree(base, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (other / "chat_template.jinja").read_text()
    changed = template.replace("<|im_start|>", "<|im_start|> ", 1)
    if "chat_template" in config:
        config["chat_template"] = changed
        (other / "tokenizer_config.json").write_text(json.dumps(config))
    else:
        (other / "chat_template.jinja").write_text(changed)
    tuneport.export(base=other, target="gguf", quant="f32", name="changed", out=tmp_path / "gguf")
    report = verify(artifact=tmp_path / "gguf" / "changed-F32.gguf", reference=base)
    assert list(_failed(report)) == ["chat_template"]
    assert "renders differently" in report.failure_line()


def test_missing_chat_template_is_caught(qwen, tmp_path):
    base, _, _, _ = qwen
    other = tmp_path / "base"
    shutil.copytree(base, other)
    (other / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    tuneport.export(base=other, target="gguf", quant="f32", name="bare", out=tmp_path / "gguf")
    report = verify(artifact=tmp_path / "gguf" / "bare-F32.gguf", reference=base)
    assert "the artifact has no chat template" in _failed(report)["chat_template"]["detail"]


def test_rslora_written_as_alpha_over_r_is_caught(qwen, tmp_path):
    """The upstream converter's mistake: adapter.lora.alpha = lora_alpha for an rsLoRA adapter (llama.cpp
    then scales by alpha/r instead of PEFT's alpha/sqrt(r)): a quarter of the strength at r=16."""
    from gguf import GGUFReader

    base, adapter, out, lora = qwen
    wrong = tmp_path / "style-alpha-over-r.gguf"
    shutil.copy(lora, wrong)
    field = GGUFReader(wrong, "r+").fields["adapter.lora.alpha"]
    assert field.parts[field.data[0]][0] == pytest.approx(8 * 16 ** 0.5)  # ours: alpha * sqrt(r)
    field.parts[field.data[0]][0] = 8.0  # lora_alpha as it is
    del field
    report = verify(artifact=out / f"{base.name}-F32.gguf", reference=base, adapter=adapter, lora=wrong)
    assert list(_failed(report)) == ["strength_error<=0.1"]
    assert report.metrics["strength"] < 0.6  # a quarter of the weight delta; the logits are not linear in it
    assert "LoRA strength" in report.failure_line()


def test_merge_into_a_different_base_is_caught(qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapter, _, _ = qwen
    other = tmp_path / "other-base"
    shutil.copytree(base, other)
    for f in other.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name in tensors:
            if name.endswith("mlp.down_proj.weight"):
                tensors[name] = tensors[name] * 1.5
        save_file(tensors, str(f), metadata={"format": "pt"})
    tuneport.export(base=other, adapters=[str(adapter)], target="gguf", quant="f32", name="merged",
                    out=tmp_path / "gguf")
    report = verify(artifact=tmp_path / "gguf" / "merged-F32.gguf", reference=base, adapter=adapter,
                    gates=["kl<=0.01"])
    assert list(_failed(report)) == ["kl<=0.01"] and report.metrics["kl"] > 0.01
    good = tmp_path / "good"
    tuneport.export(base=base, adapters=[str(adapter)], target="gguf", quant="f32", name="merged", out=good)
    assert verify(artifact=good / "merged-F32.gguf", reference=base, adapter=adapter, gates=["kl<=0.01"]).passed


def test_wrong_pre_tokenizer_is_caught(qwen, tmp_path):
    base, _, _, _ = qwen
    tuneport.export(base=base, target="gguf", quant="f32", bpe_pre="gpt-2", name="gpt2pre", out=tmp_path / "gguf",
                    accept_tokenizer_difference=True)  # export refuses it otherwise; verify reads other tools' files
    report = verify(artifact=tmp_path / "gguf" / "gpt2pre-F32.gguf", reference=base)
    assert "tokenizer" in _failed(report)
    assert "strings tokenize differently" in _failed(report)["tokenizer"]["detail"]


def test_non_legacy_sentencepiece_differs_in_llamacpp(tmp_path):
    """A real difference verify reports: a SentencePiece tokenizer with a space prefix is run by transformers 5 with
    Metaspace (no space after special tokens, none before text that starts with one), while llama.cpp always adds
    one. ``export`` refuses such a file; written anyway, verify names the same failures."""
    from tuneport.toolkit.tiny import make_base
    from tuneport.toolkit.tiny.tokenizers import TOKENIZER_WRITERS

    TOKENIZER_WRITERS["sentencepiece_prefixed"](tmp_path / "tokenizer")
    base = make_base("llama", tmp_path / "base", tokenizer_dir=tmp_path / "tokenizer")
    with pytest.raises(tuneport.UserError, match="prepend_scheme 'first'"):
        tuneport.export(base=base, target="gguf", quant="f32", out=tmp_path / "gguf")
    tuneport.export(base=base, target="gguf", quant="f32", out=tmp_path / "gguf", accept_tokenizer_difference=True)
    report = verify(artifact=tmp_path / "gguf" / f"{base.name}-F32.gguf", reference=base, gates=["max_abs<=1e-4"])
    assert set(_failed(report)) == {"tokenizer", "chat_template"}
    assert report.metrics["max_abs"] <= 1e-4


def test_cli_json_exit_codes_and_reference_cache(qwen, cli, tmp_path):
    from tuneport.convert.cache import cache_dir

    base, adapter, out, lora = qwen
    model = out / f"{base.name}-Q8_0.gguf"
    code, stdout, _ = cli("verify", model, "--reference", base, "--adapter", adapter, "--lora", lora, "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["passed"] and report["engine"] == "llama.cpp" and report["metrics"]["kl"] < 0.02
    cached = sorted((cache_dir() / "verify").glob("*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in cached]
    code, stdout, err = cli("verify", model, "--reference", base, "--adapter", adapter, "--lora", lora,
                            "--gate", "kl<=1e-9")
    assert code == 3 and "kl<=1e-09" in err and model.name in err and "FAILED" in stdout
    assert sorted((cache_dir() / "verify").glob("*.safetensors")) == cached  # computed once
    assert [p.stat().st_mtime_ns for p in cached] == stamps
    other = tmp_path / "other.txt"
    other.write_text("not a model")
    for args, says in [
        (["verify", model, "--reference", base, "--gate", "kl<0.1"], "bad gate"),
        (["verify", tmp_path / "none.gguf", "--reference", base], "does not exist"),
        (["verify", lora, "--reference", base], "is a GGUF LoRA, not a model"),
        (["verify", model, "--reference", base, "--lora", lora], "--lora needs --adapter"),
        (["verify", other, "--reference", base], "tuneport verify cannot run other.txt"),
    ]:
        code, stdout, err = cli(*args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)


def test_python_api_is_the_cli_function():
    import tuneport.toolkit.verify as v

    assert tuneport.verify is v.verify and tuneport.VerifyOptions is VerifyOptions


def test_upstream_converters_are_verified(zoo, upstream, tmp_path):
    """A GGUF and a GGUF LoRA written by llama.cpp's own convert_hf_to_gguf.py / convert_lora_to_gguf.py:
    the model's numbers are exact, and the LoRA of an rsLoRA adapter comes out at the wrong strength
    (it is written with alpha/r), which tuneport's LoRA of the same adapter does not."""
    base, adapter = zoo.base("llama"), zoo.adapter("llama", "rslora")
    model, lora = tmp_path / "upstream-F32.gguf", tmp_path / "upstream-lora-F32.gguf"
    upstream("convert_hf_to_gguf.py", base, "--outfile", model, "--outtype", "f32")
    upstream("convert_lora_to_gguf.py", "--base", base, "--outfile", lora, "--outtype", "f32", adapter)
    alone = verify(artifact=model, reference=base, gates=["max_abs<=1e-4"], default_gates=False)
    assert alone.passed, alone.failure_line()
    wrong = verify(artifact=model, reference=base, adapter=adapter, lora=lora)
    assert "strength_error<=0.1" in _failed(wrong) and wrong.metrics["strength"] < 0.6
    tuneport.export(base=base, adapters=[f"style={adapter}"], target="gguf", adapter_mode="separate", quant="f32",
                    out=tmp_path / "ours")
    our_lora = tmp_path / "ours" / "adapters" / "style-F32.gguf"
    ours = verify(artifact=model, reference=base, adapter=adapter, lora=our_lora, gates=["max_abs<=1e-3"])
    assert "strength_error<=0.1" not in _failed(ours) and "max_abs<=0.001" not in _failed(ours)


def _numeric_failures(report) -> dict:
    """Every failed gate, the tokenizer checks included: the tiny SentencePiece fixtures (no space prefix) are run
    by llama.cpp exactly as transformers runs them."""
    return _failed(report)


def _table(target: str) -> list[str]:
    from tuneport.convert.support_matrix import supported
    from tuneport.toolkit.tiny import TINY_ARCHS

    return [a for a in supported(target) if a in TINY_ARCHS and not TINY_ARCHS[a].text_config_class]


def _adapter_for(zoo, arch: str):
    from tuneport.convert.arch import ARCHS

    return zoo.adapter(arch, "experts" if ARCHS[arch].experts else "all_linear")


@pytest.mark.parametrize("arch", _table("gguf"))
def test_verify_every_architecture_gguf(zoo, tmp_path, arch):
    """tuneport verify of each architecture's F32 GGUF + GGUF LoRA (expert LoRA for the MoE ones) in llama.cpp:
    every numeric gate passes (Gemma's GELU table within 5e-3)."""
    base, adapter = zoo.base(arch), _adapter_for(zoo, arch)
    out = tmp_path / "gguf"
    tuneport.export(base=base, adapters=[f"a={adapter}"], target="gguf", adapter_mode="separate", quant="f32", out=out)
    # Gemma 4 runs more GELUs per layer through that table (tests/test_gguf_export.py: 7.8e-3 on the base, 1.5e-2 with
    # an all-linear LoRA, 1.4e-3 with the table emulated): 2.3e-2 here, and one of 255 positions whose top two logits
    # are that close changes its top-1
    gates = ["max_abs<=3e-2", "top1>=0.99"] if arch.startswith("gemma4") else ["max_abs<=5e-3", "top1>=1"]
    report = verify(artifact=out / f"{base.name}-F32.gguf", reference=base, adapter=adapter,
                    lora=out / "adapters" / "a-F32.gguf", gates=[*gates, "greedy>=1"])
    assert not _numeric_failures(report), report.failure_line()
    assert report.metrics["strength_error"] <= 1e-2, report.metrics


@pytest.mark.parametrize("arch", _table("mlx"))
def test_verify_every_architecture_mlx(zoo, tmp_path, arch):
    """tuneport verify of each architecture's MLX export with its mlx-lm adapter, in mlx-lm."""
    pytest.importorskip("mlx_lm")
    base, adapter = zoo.base(arch), _adapter_for(zoo, arch)
    if arch == "gemma3_text":  # mlx-lm's Gemma 3 needs a global layer; the zoo's two layers are both sliding
        from tuneport.toolkit.tiny import make_adapter, make_base

        base = make_base(arch, tmp_path / "base", dims={"layer_types": ["sliding_attention", "full_attention"],
                                                         "sliding_window": 4})
        adapter = make_adapter(base, "all_linear", tmp_path / "adapter")
    out = tmp_path / "mlx"
    tuneport.export(base=base, adapters=[f"a={adapter}"], target="mlx", adapter_mode="separate", out=out)
    # Qwen3.5-MoE: fp32's order of operations alone moves its logits 1.1-1.5e-3 (PEFT's own merge_and_unload, 1.45e-3)
    limit = "2e-3" if arch.startswith("qwen3_5_moe") else "1e-3"
    report = verify(artifact=out, reference=base, adapter=adapter, lora=out / "adapters" / "a",
                    gates=[f"max_abs<={limit}", "top1>=1", "greedy>=1"])
    assert not _numeric_failures(report), report.failure_line()


def test_the_reference_cache_tells_configs_apart(zoo, tmp_path):
    """Two bases with the same weight files and different config.json compute different things (the tiny llama
    and granite share their weights): the cached fp32 reference of one is never served for the other."""
    import json
    import shutil

    from tuneport.toolkit.verify.reference import reference

    other = tmp_path / "other"
    shutil.copytree(zoo.base("llama"), other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.5}))
    a = reference(zoo.base("llama"), None, None, 32, 4)
    b = reference(other, None, None, 32, 4)
    assert a.ids == b.ids and (a.logits - b.logits).abs().max() > 0.01
