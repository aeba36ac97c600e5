"""Bad input: exit code 2, one line naming the problem and the fix, nothing at the output path."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tuneport.toolkit.tiny import make_adapter, make_base


def copy_base(zoo, tmp_path: Path) -> Path:
    dst = tmp_path / "base"
    shutil.copytree(zoo.base("llama"), dst)
    return dst


def copy_adapter(zoo, tmp_path: Path, variant: str = "plain") -> Path:
    dst = tmp_path / "adapter"
    shutil.copytree(zoo.adapter("llama", variant), dst)
    return dst


def assert_refused(cli, out: Path, *args, expect: str) -> str:
    code, stdout, stderr = cli(*args)
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert expect.lower() in lines[0].lower(), lines[0]
    assert "Traceback" not in stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".tuneport-tmp-{out.name}-*")), "temporary left behind"
    return lines[0]


def merge_args(base, adapter, out, *extra):
    return ("merge", "--base", base, "--adapter", adapter, "--out", out, *extra)


def first_shard(base: Path) -> Path:
    return sorted(base.glob("*.safetensors"))[1]


def test_truncated_safetensors(zoo, tmp_path, cli):
    base = copy_base(zoo, tmp_path)
    shard = first_shard(base)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert_refused(cli, out, *merge_args(base, zoo.adapter("llama", "plain"), out), expect=shard.name)


def test_header_length_larger_than_file(zoo, tmp_path, cli):
    base = copy_base(zoo, tmp_path)
    shard = first_shard(base)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 10)
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    line = assert_refused(cli, out, *merge_args(base, zoo.adapter("llama", "plain"), out), expect="header length")
    assert "larger than the file" in line


def test_corrupt_header_json(zoo, tmp_path, cli):
    base = copy_base(zoo, tmp_path)
    shard = first_shard(base)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#garbage####"
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_refused(cli, out, *merge_args(base, zoo.adapter("llama", "plain"), out), expect="corrupt header JSON")


def test_adapter_for_a_different_base(zoo, tmp_path, cli):
    small = make_base("llama", tmp_path / "small", dims=dict(hidden_size=64, intermediate_size=128,
                                                             num_attention_heads=2, num_key_value_heads=1))
    adapter = make_adapter(small, "plain", tmp_path / "small-adapter")
    out = tmp_path / "out"
    line = assert_refused(cli, out, *merge_args(zoo.base("llama"), adapter, out), expect="does not fit this base")
    assert "[128, 128] in the base" in line and "pass the base it was trained on" in line


def test_adapter_targets_module_the_base_lacks(zoo, tmp_path, cli):
    adapter = copy_adapter(zoo, tmp_path)
    f = adapter / "adapter_model.safetensors"
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in load_file(f).items()}, str(f))
    out = tmp_path / "out"
    line = assert_refused(cli, out, *merge_args(zoo.base("llama"), adapter, out), expect="which the base lacks")
    assert "model.layers.7.self_attn" in line


def test_missing_adapter_config(zoo, tmp_path, cli):
    adapter = copy_adapter(zoo, tmp_path)
    (adapter / "adapter_config.json").unlink()
    out = tmp_path / "out"
    assert_refused(cli, out, *merge_args(zoo.base("llama"), adapter, out), expect="has no adapter_config.json")


def test_pickle_only_checkpoint_needs_allow_pickle(zoo, tmp_path, cli):
    src = zoo.base("llama")
    base = tmp_path / "pickled"
    base.mkdir()
    sd = {}
    for f in src.glob("*.safetensors"):
        sd.update(load_file(f))
    torch.save(sd, base / "pytorch_model.bin")
    for f in src.iterdir():
        if f.suffix == ".json" and "safetensors" not in f.name or f.name.startswith("tokenizer"):
            shutil.copy(f, base / f.name)
    out = tmp_path / "out"
    line = assert_refused(cli, out, *merge_args(base, zoo.adapter("llama", "plain"), out), expect="pickle")
    assert "--allow-pickle" in line
    code, _, err = cli(*merge_args(base, zoo.adapter("llama", "plain"), out, "--allow-pickle"))
    assert code == 0, err
    merged = load_file(out / "model.safetensors")
    assert set(merged) == set(sd)


def test_existing_output_without_force(zoo, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = cli(*merge_args(zoo.base("llama"), zoo.adapter("llama", "plain"), out))
    assert code == 2 and "already exists" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, _, err = cli(*merge_args(zoo.base("llama"), zoo.adapter("llama", "plain"), out, "--force"))
    assert code == 0, err
    assert (out / "model.safetensors").exists() and not (out / "keep.txt").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_adapter(zoo, tmp_path, cli, bad):
    adapter = copy_adapter(zoo, tmp_path)
    f = adapter / "adapter_model.safetensors"
    sd = load_file(f)
    key = sorted(k for k in sd if "lora_B" in k)[0]
    sd[key][0, 0] = bad
    save_file(sd, str(f))
    out = tmp_path / "out"
    line = assert_refused(cli, out, *merge_args(zoo.base("llama"), adapter, out), expect="NaN or Inf")
    assert key in line


@pytest.mark.parametrize("key,value,expect", [
    ("layer_replication", [[0, 1]], "layer_replication"),
    ("init_lora_weights", "pissa", "path_initial_model_for_weight_conversion"),
    ("peft_type", "LOHA", "only LoRA"),
    ("some_future_option", {"x": 1}, "unknown PEFT option"),
])
def test_unsupported_peft_flags_are_refused(zoo, tmp_path, cli, key, value, expect):
    adapter = copy_adapter(zoo, tmp_path)
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    assert_refused(cli, out, *merge_args(zoo.base("llama"), adapter, out), expect=expect)


def test_missing_base_is_a_clear_error(tmp_path, cli, zoo):
    out = tmp_path / "out"
    args = merge_args(tmp_path / "nope", zoo.adapter("llama", "plain"), out)
    assert_refused(cli, out, *args, expect="does not exist")


def test_unsupported_architecture_for_vllm_lists_supported(zoo, tmp_path, cli):
    base = copy_base(zoo, tmp_path)
    cfg = json.loads((base / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (base / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    line = assert_refused(cli, out, "export", "--base", base, "--target", "vllm", "--adapters", "separate",
                          "--adapter", zoo.adapter("llama", "plain"), "--out", out, expect="unsupported architecture")
    assert "llama" in line and "qwen2" in line


def test_debug_shows_traceback(zoo, tmp_path, cli):
    adapter = copy_adapter(zoo, tmp_path)
    (adapter / "adapter_config.json").unlink()
    code, _, err = cli("--debug", *merge_args(zoo.base("llama"), adapter, tmp_path / "out"))
    assert code == 2 and "Traceback" in err
