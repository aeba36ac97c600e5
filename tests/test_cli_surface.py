"""The CLI's surface: usage errors are the user's (exit 2, usage shown), every option is honoured or refused,
the same inputs everywhere (hub ids), and the review fixes of the redesign (rank limit, dry-run writes
nothing)."""

from __future__ import annotations

import json
import shutil

import pytest

import tuneport


@pytest.mark.parametrize("args,problem", [
    (["serve", "--base", "x", "--bogus"], "No such option: --bogus"),
    (["export", "--base", "x", "--target", "nope", "--out", "o"], "Invalid value for '--target'"),
    (["serve", "--base", "x", "--engine", "exllama"], "Invalid value for '--engine'"),
    (["merge", "--base", "x", "--out", "o"], "Missing option '--adapter'"),
    (["merge", "--base", "x", "--adapter", "a", "--out", "o", "--dtype", "float32"], "Invalid value for '--dtype'"),
    (["inspect"], "Missing argument 'PATH'"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_usage_errors_exit_2_with_usage(cli, args, problem):
    code, out, err = cli(*args)
    assert code == 2, (code, err)
    assert "Usage: tuneport" in err and problem in err, err
    assert "internal error" not in err and "Traceback" not in err and out == ""


def test_help_lists_only_what_works(cli):
    code, out, _ = cli("export", "--help")
    assert code == 0 and all(t in out for t in ("safetensors", "gguf", "awq", "mlx", "exl3"))
    code, out, _ = cli("serve", "--help")
    assert code == 0 and all(e in out for e in ("llamacpp", "vllm", "mlx", "exllamav3"))


def test_serve_bad_input_exits_2(tmp_path, cli):
    code, _, err = cli("serve", "--base", tmp_path / "nope.gguf")
    assert code == 2 and "nope.gguf does not exist" in err
    code, _, err = cli("serve", "--base", tmp_path / "nope.gguf", "--engine", "llamacpp")
    assert code == 2 and "nope.gguf does not exist" in err
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf")
    code, _, err = cli("serve", "--base", bad, "--engine", "vllm")
    assert code == 2 and "not GGUF" in err and "--engine llamacpp" in err
    code, _, err = cli("serve", "--base", bad, "--engine", "llamacpp")
    assert code == 2 and "not a valid GGUF file" in err
    code, _, err = cli("serve", "--base", bad, "--engine", "llamacpp", "--", "--enforce-eager")
    assert code == 2 and "arguments after --: only --engine vllm honours it" in err


@pytest.mark.parametrize("args,expect", [
    (["--target", "gguf", "--dtype", "bf16"], "--dtype does not apply to --target gguf: choose the GGUF type"),
    (["--target", "safetensors", "--quant", "q8_0"], "--quant does not apply to --target safetensors"),
    (["--target", "vllm", "--bpe-pre", "qwen2"], "--bpe-pre does not apply to --target vllm"),
    (["--target", "gguf", "--max-lora-rank", "16"], "--max-lora-rank does not apply to --target gguf"),
    (["--target", "safetensors", "--adapters", "separate"], "--target safetensors writes --adapters merge only"),
    (["--target", "vllm", "--max-lora-rank", "16"], "--max-lora-rank applies to --adapters separate"),
])
def test_export_options_a_target_does_not_honour_are_refused(zoo, tmp_path, cli, args, expect):
    out = tmp_path / "out"
    code, _, err = cli("export", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"),
                       "--out", out, *args)
    assert code == 2 and expect in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_serve_options_of_the_other_engine_are_refused(zoo, cli):
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--engine", "llamacpp", "--max-lora-rank", "16",
                       "--dry-run")
    assert code == 2 and "--max-lora-rank: only --engine vllm honours it" in err
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--engine", "vllm", "--kv-f32", "--dry-run")
    assert code == 2 and "--kv-f32: only --engine llamacpp honours it" in err
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--engine", "vllm", "--n-ctx", "64", "--dry-run")
    assert code == 2 and "--n-ctx: only --engine llamacpp, mlx or exllamav3 honours it" in err
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--engine", "mlx", "--max-loras", "2", "--dry-run")
    assert code == 2 and "--max-loras: only --engine vllm honours it, this server runs mlx" in err


def test_hub_ids_are_accepted_everywhere(zoo, tmp_path, cli, monkeypatch):
    """serve --base and every --adapter take hub ids as merge/export do (offline here: the hub's own error)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = cli("serve", "--base", "no-such-org/no-such-model", "--dry-run")
    assert code == 2 and "cannot fetch no-such-org/no-such-model" in err and "HF_HUB_OFFLINE" in err
    code, _, err = cli("export", "--base", zoo.base("llama"), "--adapter", "no-such-org/no-such-lora", "--target",
                       "vllm", "--adapters", "separate", "--out", tmp_path / "o")
    assert code == 2 and "cannot fetch no-such-org/no-such-lora" in err
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--adapter", "a=no-such-org/no-such-lora", "--dry-run")
    assert code == 2 and "cannot fetch no-such-org/no-such-lora" in err


def test_startup_adapter_above_vllms_largest_rank_exits_2(zoo, tmp_path, cli):
    big = tmp_path / "big"
    shutil.copytree(zoo.adapter("llama", "plain"), big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    cfg["r"] = 1024
    (big / "adapter_config.json").write_text(json.dumps(cfg))
    for extra in (["--dry-run"], ["--port", "0"]):  # planned or started: the same check, before vLLM runs
        code, _, err = cli("serve", "--engine", "vllm", "--base", zoo.base("llama"), "--adapter", f"big={big}", *extra)
        assert code == 2, err
        assert "adapter big has rank 1024, above vLLM's largest --max-lora-rank 512" in err and "merge it" in err


def test_dry_run_writes_nothing(zoo, tmp_path, monkeypatch):
    """The plan names the fixed adapter copy and the guard adapter it would write, but writes neither."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(cache))
    plan = tuneport.serve_plan(base=zoo.base("llama"), adapters={"rx": zoo.adapter("llama", "regex")},
                               engine="vllm", vllm_base_guard="on", port=9000)
    vllm_argv = plan["commands"][1]["argv"]
    modules = {m["name"]: m["path"] for m in map(json.loads, (a for a in vllm_argv if a.startswith("{\"name\"")))}
    assert str(cache / "vllm-adapters") in modules["rx"]  # a regex target_modules needs a fixed copy
    assert str(cache / "vllm-guard") in modules["tuneport-base"]
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))
    tuneport.serve_plan(base=zoo.base("llama"), engine="llamacpp")  # an HF base llama.cpp would convert
    assert not cache.exists() or not any(cache.rglob("*"))


def test_hub_ids_serve_under_their_name(hub):
    base, lora = hub
    plan = tuneport.serve_plan(base=base, adapters={"chat": lora}, engine="vllm")
    gateway, vllm = plan["commands"]
    assert gateway["argv"][gateway["argv"].index("--base") + 1] == base
    argv = vllm["argv"]
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    assert [json.loads(a)["name"] for a in argv if a.startswith("{\"name\"")][0] == "chat"


def test_serve_refusals_before_anything_starts(zoo, tmp_path, cli, monkeypatch):
    from tuneport.serve.registry import EngineSpec

    gguf = tmp_path / "m.gguf"
    tuneport.export(base=zoo.base("llama"), target="gguf", quant="f32", out=tmp_path / "g")
    shutil.copy(tmp_path / "g" / "llama-fp32-F32.gguf", gguf)
    cases = [
        (["--base", gguf, "--engine", "vllm", "--dry-run"], "vLLM (--engine vllm) serves HF safetensors"),
        (["--base", gguf, "--dtype", "bf16", "--dry-run"], "--dtype bf16 applies to an HF base"),
        (["--base", gguf, "--replicas", "2", "--port", "0"], "--replicas applies to --on ray and to the dry run"),
        (["--base", gguf, "--json"], "--json applies to --dry-run"),
    ]
    for args, expect in cases:
        code, _, err = cli("serve", *args)
        assert code == 2 and expect in err, (args, err)
    monkeypatch.setattr(EngineSpec, "installed", lambda self: self.name != "llamacpp")
    code, _, err = cli("serve", "--base", gguf, "--engine", "llamacpp", "--port", "0")
    assert code == 2 and "llama.cpp (--engine llamacpp) is not installed here" in err
    assert "pip install 'tuneport[llamacpp]'" in err
