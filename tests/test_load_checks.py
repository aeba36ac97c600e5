"""Every HF / vLLM export is opened by the readers its engines use before it is renamed into place: config and
tokenizer through transformers, tensor names and shapes against the model built from that config, vLLM
adapters through PEFT against the base's modules. A failure is exit 2 with the reason, nothing at the path."""

from __future__ import annotations

import json

import pytest

from tuneport.convert import export_hf

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_and_vllm_exports_record_their_load_check(zoo, tmp_path, cli, arch):
    out = tmp_path / "merged"
    code, _, err = cli("merge", "--base", zoo.base(arch), "--adapter", zoo.adapter(arch, "all_linear"), "--out", out)
    assert code == 0, err
    check = json.loads((out / "manifest.json").read_text())["load_check"]
    assert check.startswith("loaded by transformers' readers: config, tokenizer, "), check
    bundle = tmp_path / "vllm"
    code, _, err = cli("export", "--target", "vllm", "--adapters", "separate", "--base", zoo.base(arch),
                       "--adapter", f"a={zoo.adapter(arch, 'all_linear')}", "--out", bundle)
    assert code == 0, err
    check = json.loads((bundle / "manifest.json").read_text())["load_check"]
    assert check["base"].startswith("loaded by transformers' readers") and check["adapters"].startswith(
        "read by PEFT and checked against the base's modules: 1 adapter(s)"), check


def _refused(cli, out, *args, expect: str) -> None:
    code, _, err = cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expect in err, err
    assert "Traceback" not in err and not out.exists()
    assert not list(out.parent.glob(f".tuneport-tmp-{out.name}-*"))


def test_a_merged_directory_with_a_tensor_missing_is_refused(zoo, tmp_path, cli, monkeypatch):
    write = export_hf.write_merged

    def dropping_one(plan, out, *args, **kw):
        hashes = write(plan, out, *args, **kw)
        from safetensors.torch import load_file, save_file

        shard = sorted(out.glob("*.safetensors"))[0]
        tensors = load_file(shard)
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, shard)
        return hashes

    monkeypatch.setattr(export_hf, "write_merged", dropping_one)
    out = tmp_path / "merged"
    _refused(cli, out, "merge", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"), "--out", out,
             expect="error: the exported model has 1 tensor(s) missing for LlamaForCausalLM (first: ")


def test_a_merged_directory_with_a_broken_config_is_refused(zoo, tmp_path, cli, monkeypatch):
    write = export_hf.write_merged

    def bad_config(plan, out, *args, **kw):
        hashes = write(plan, out, *args, **kw)
        cfg = json.loads((out / "config.json").read_text())
        cfg["num_attention_heads"] = "many"
        (out / "config.json").write_text(json.dumps(cfg))
        return hashes

    monkeypatch.setattr(export_hf, "write_merged", bad_config)
    out = tmp_path / "merged"
    _refused(cli, out, "merge", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"), "--out", out,
             expect="error: transformers cannot read the exported config.json: ")
