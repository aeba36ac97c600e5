"""``--gpu-layers`` on a machine whose llama.cpp is a CPU build: the default resolves to 0, asking for GPU layers
is refused with the reason (exit 2) by serve, verify, release and the demo's API, 0 runs and answers as before;
the memory plan's VRAM for offloaded layers (doctor's backend line: tests/test_inspect_doctor.py). The GPU
numbers come from ``benchmarks/gpu/device.sh run llamacpp`` on a CUDA machine."""

from __future__ import annotations

import json

import httpx
import pytest
from test_release import write_recipe
from tests_helpers import fresh_greedy

import tuneport
from tuneport.convert.errors import UserError
from tuneport.convert.gguf.gpu import (
    LlamaCppCompute,
    llamacpp_compute,
    n_gpu_layers,
    offloaded_layers,
    parse_gpu_layers,
)

CPU_BUILD = LlamaCppCompute(False, ("CPU",))
CUDA_BUILD = LlamaCppCompute(True, ("CUDA", "CPU"))


@pytest.fixture(scope="module")
def gguf(zoo, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-layers") / "gguf"
    tuneport.export(base=zoo.base("llama"), adapters=[f"plain={zoo.adapter('llama', 'plain')}"], target="gguf",
                    adapter_mode="separate", quant="f32", out=out)
    return out / "llama-fp32-F32.gguf", out / "adapters" / "plain-F32.gguf"


def test_gpu_layers_resolve_as_llamacpp_takes_them():
    assert [parse_gpu_layers(v) for v in (None, "all", "ALL", "0", "12", 7)] == [None, "all", "all", 0, 12, 7]
    for bad in ("-1", "some", -3, 1.5):
        with pytest.raises(UserError, match="--gpu-layers"):
            parse_gpu_layers(bad)
    # a GPU build: everything by default (-1 = all in llama_model_params), or the count asked
    assert [n_gpu_layers(v, CUDA_BUILD) for v in (None, "all", 0, 5)] == [-1, -1, 0, 5]
    # a CPU build: nothing by default; GPU layers asked for are refused, not silently run on the CPU
    assert [n_gpu_layers(v, CPU_BUILD) for v in (None, 0, "0")] == [0, 0, 0]
    for asked in ("all", 3):
        with pytest.raises(UserError, match="has no GPU backend") as e:
            n_gpu_layers(asked, CPU_BUILD)
        assert "GGML_CUDA=on" in e.value.hint and "--gpu-layers 0" in e.value.hint


def test_offloaded_layers_follow_llamacpps_split():
    """llama.cpp offloads the last n_gpu_layers of the n_layer + 1 (the output layer last): 1 is the output
    layer alone, n_layer + 1 or more (or -1) is every layer; the token embeddings never move."""
    assert [offloaded_layers(n, 4) for n in (0, 1, 2, 4, 5, 9, -1)] == [
        (0, False), (0, True), (1, True), (3, True), (4, True), (4, True), (4, True)]


def test_this_machine_is_a_cpu_build():
    import llama_cpp

    compute = llamacpp_compute()
    assert compute.gpu_offload is bool(llama_cpp.llama_supports_gpu_offload()) is False
    assert compute.label == "CPU" and compute.backends[0] == "CPU" and compute.gpu_devices == ()
    assert any(d.kind == "cpu" for d in compute.devices)


@pytest.mark.llamacpp
def test_serve_verify_and_release_refuse_gpu_layers_on_a_cpu_build(gguf, zoo, cli, tmp_path):
    model, lora = gguf
    code, out, err = cli("serve", "--base", model, "--gpu-layers", "2", "--port", "0")
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: --gpu-layers 2: the loaded llama.cpp has no GPU backend")
    code, _, err = cli("verify", model, "--reference", zoo.base("llama"), "--gpu-layers", "all")
    assert code == 2 and "no GPU backend" in err, err
    code, _, err = cli("serve", "--base", model, "--gpu-layers", "many", "--port", "0")
    assert code == 2 and "neither a number of layers nor 'all'" in err, err
    recipe = write_recipe(tmp_path / "recipe.yaml", zoo.base("llama"), {"plain": zoo.adapter("llama", "plain")})
    from tuneport.toolkit.release import release

    with pytest.raises(UserError, match="no GPU backend"):
        release(recipe=recipe, out=tmp_path / "release", gpu_layers=1)
    assert not (tmp_path / "release").exists()  # refused before any export
    code, _, err = cli("serve", "--engine", "vllm", "--base", zoo.base("llama"), "--gpu-layers", "1", "--dry-run")
    assert code == 2 and "--gpu-layers: only --engine llamacpp honours it" in err, err
    with pytest.raises(UserError, match="applies to GGUF files"):
        tuneport.verify(artifact=zoo.base("llama"), reference=zoo.base("llama"), gpu_layers=0)


@pytest.mark.llamacpp
def test_gpu_layers_0_serves_and_verifies_as_before(gguf, zoo, cli):
    model, lora = gguf
    prompt = [1, 50, 60, 70]
    with tuneport.serve(base=model, adapters={"plain": lora}, gpu_layers=0, kv_f32=True, n_ctx=64, port=0) as server:
        assert server.backend.describe()["gpu_layers"] == 0 and server.backend.describe()["compute"] == "CPU"
        for name, adapter in (("llama-fp32-F32", None), ("plain", lora)):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == fresh_greedy(model, adapter, prompt, 6)
    code, out, err = cli("verify", model, "--reference", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain"),
                         "--lora", lora, "--gpu-layers", "0", "--tokens", "32", "--json")
    assert code == 0, err
    assert json.loads(out)["metrics"]["max_abs"] < 1e-3


@pytest.mark.llamacpp
def test_dry_run_counts_vram_for_offloaded_layers(gguf, cli):
    """The plan with --gpu-layers: the offloaded layers' share of weights, KV cache and LoRAs plus the output
    layer in VRAM (per_gpu), the rest in RAM (host); asked for on a CPU build, a note says serve would refuse."""
    from tuneport.serve.policy import describe_artifact

    model, lora = gguf
    a = describe_artifact(model)
    plans = {}
    for layers in ("0", "1", "2", "all"):
        code, out, err = cli("serve", "--base", model, "--adapter", f"plain={lora}", "--gpu-layers", layers,
                             "--dry-run", "--json")
        assert code == 0, err
        d = json.loads(out)
        plans[layers] = d["plans"]["llamacpp"]
        if layers != "0":
            assert any("no GPU backend" in n for n in d["notes"]) and "--gpu-layers" in d["commands"][0]["argv"]
    p0, p1, p2, pall = (plans[k] for k in ("0", "1", "2", "all"))
    assert p0["per_gpu"] is None and p0["host"] == 0
    per_param = a.weight_bytes / a.params
    table = int(a.vocab_size * a.hidden_size * per_param)
    per_layer = (a.weight_bytes - 2 * table) / a.n_layers
    assert a.n_layers == 2
    assert p1["per_gpu"] == table  # the output layer alone
    assert p2["per_gpu"] == int(per_layer + table + (p2["kv_cache"] + p2["adapters"]) / 2)
    assert pall["per_gpu"] == int(2 * per_layer + table + pall["kv_cache"] + pall["adapters"])
    for p in (p1, p2, pall):
        assert p["per_gpu"] + p["host"] == p["total"] == p0["total"]
        assert "--gpu-layers" in p["formula"]["per_gpu"]

