"""``tuneport release``: a recipe over a tiny base and two adapters (GGUF separate and merged, vLLM) runs,
its gates pass and the release directory is complete; a strict gate fails with exit 3 naming the artifact
and the metric, and nothing is published; a bad recipe exits 2 naming the key; a rerun skips what is
intact, a rebuilt target is byte-identical, a killed run resumes; --push --dry-run lists the upload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.llamacpp, pytest.mark.vllm]
ALL_TARGETS = """
  - {type: gguf, quant: [q8_0, q4_0], adapters: separate}
  - {type: gguf, quant: [q8_0], adapters: merge}
  - {type: vllm}
  - {type: safetensors}"""
GGUF_ONLY = """
  - {type: gguf, quant: [q8_0, q4_0], adapters: separate}"""


def write_recipe(path: Path, base: Path, adapters: dict[str, Path], gates: str = "{kl: {default: 1.0, q8_0: 0.05}, "
                 "strength_error: 0.3}", targets: str = GGUF_ONLY) -> Path:
    path.write_text(f"""
name: tiny-release
version: 0.1.0
license: apache-2.0
base: {{path: {base}}}
adapters:
{''.join(f'  - {{name: {n}, path: {p}}}{chr(10)}' for n, p in adapters.items())}
targets:{targets}
eval: {{tokens: 128}}
gates: {gates}
publish: {{repo: tiny-org/tiny-release, private: true, tag: v0.1.0}}
""")
    return path


@pytest.fixture(scope="module")
def inputs(zoo):
    base = zoo.base("qwen2", wide=True)
    return base, {"style": zoo.adapter("qwen2", "rslora", wide=True), "chat": zoo.adapter("qwen2", "plain", wide=True)}


@pytest.fixture(scope="module")
def released(inputs, tmp_path_factory):
    from tuneport.toolkit.release import release

    root = tmp_path_factory.mktemp("release")
    recipe = write_recipe(root / "recipe.yaml", *inputs, targets=ALL_TARGETS)
    summary = release(recipe=recipe, out=root / "out")
    return root, recipe, summary


def test_release_directory_is_complete(released):
    root, _, summary = released
    out = root / "out"
    assert summary["passed"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["sha256"] and manifest["libraries"]["torch"] and manifest["inputs"]["base"]["files"]
    verified = [a for a in manifest["artifacts"] if a["verified"]]
    # GGUF: 2 quant types x (model alone + 2 LoRAs) + the merged Q8_0; vLLM: the bundle alone + 2 adapters,
    # and the merged safetensors model (against tuneport's fp32 merge of both adapters)
    assert len(verified) == len(manifest["artifacts"]) == 11 and all(a["passed"] for a in verified)
    in_vllm = [a for a in verified if a["engine"] == "vLLM"]
    assert len(in_vllm) == 4 and all(a["metrics"]["kl"] < 1e-6 for a in in_vllm)
    assert all(abs(a["metrics"]["strength"] - 1) < 1e-3 for a in in_vllm if a["lora"])
    for o in manifest["outputs"]:
        f = out / o["path"]
        assert f.stat().st_size == o["bytes"]
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "apache-2.0" and "tuneport" in front["tags"] and front["library_name"] == "gguf"
    for a in verified:
        assert f"{a['metrics']['kl']:.2e}" in card
    assert "| vLLM |" in card
    assert "ollama create" in card and "tuneport serve --base" in card and "serve-vllm.sh" in card
    assert (out / "recipe.yaml").read_text() == (root / "recipe.yaml").read_text()
    assert (out / "artifacts" / "gguf-separate" / "Modelfile.style").exists()


def test_rerun_skips_intact_targets_and_rebuilds_byte_identical(released):
    import shutil

    from tuneport.toolkit.release import release

    root, recipe, _ = released
    out = root / "out"
    first = {o["path"]: o["sha256"] for o in json.loads((out / "manifest.json").read_text())["outputs"]
             if o["path"].endswith((".gguf", ".safetensors"))}
    stamp = (out / "artifacts" / "gguf-merge" / "tiny-release-Q8_0.gguf").stat().st_mtime_ns
    shutil.rmtree(out / "artifacts" / "gguf-separate")
    release(recipe=recipe, out=out)
    assert (out / "artifacts" / "gguf-merge" / "tiny-release-Q8_0.gguf").stat().st_mtime_ns == stamp  # skipped
    again = {o["path"]: o["sha256"] for o in json.loads((out / "manifest.json").read_text())["outputs"]
             if o["path"].endswith((".gguf", ".safetensors"))}
    assert again == first  # the rebuilt target is byte-identical


def test_strict_gate_fails_with_exit_3_and_publishes_nothing(inputs, tmp_path, cli):
    recipe = write_recipe(tmp_path / "strict.yaml", *inputs, gates="{kl: 1.0e-9}")
    code, stdout, err = cli("release", recipe, "--out", tmp_path / "out", "--push", "--dry-run")
    assert code == 3 and "create_repo" not in stdout and "release written" not in stdout
    assert "gates failed, nothing published" in err and "artifacts/gguf-separate/tiny-release-Q8_0.gguf" in err
    assert "kl<=1e-09" in err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["passed"] is False


def test_bad_recipe_exits_2_naming_the_key(inputs, tmp_path, cli):
    recipe = write_recipe(tmp_path / "bad.yaml", *inputs)
    recipe.write_text(recipe.read_text().replace("q4_0]", "q4_z]"))
    code, _, err = cli("release", recipe, "--out", tmp_path / "out")
    assert code == 2 and "targets[0].quant: 'q4_z' is not a GGUF type" in err
    assert not (tmp_path / "out").exists()


def test_push_dry_run_lists_files_hashes_and_tag(released, cli):
    root, recipe, _ = released
    code, stdout, _ = cli("release", recipe, "--out", root / "out", "--push", "--dry-run", "--json")
    assert code == 0
    plan = json.loads(stdout)["publish"]
    assert plan["dry_run"] and plan["repo"] == "tiny-org/tiny-release" and plan["tag"] == "v0.1.0"
    files = {f["path"]: f for f in plan["files"]}
    assert {"README.md", "manifest.json", "recipe.yaml"} <= set(files) and "release-state.json" not in files
    gguf = files["artifacts/gguf-separate/tiny-release-Q8_0.gguf"]
    assert gguf["lfs"] and not files["README.md"]["lfs"] and len(gguf["sha256"]) == 64
    assert gguf["bytes"] == (root / "out" / gguf["path"]).stat().st_size
    assert plan["operations"][-1] == "create_tag v0.1.0"


def test_push_without_a_token_fails_before_any_work(inputs, tmp_path, cli, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    recipe = write_recipe(tmp_path / "r.yaml", *inputs)
    code, _, err = cli("release", recipe, "--out", tmp_path / "out", "--push")
    assert code == 2 and "publishing needs a Hugging Face token" in err
    assert not (tmp_path / "out").exists()


def test_killed_run_resumes_and_finishes(inputs, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", *inputs)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tuneport", "release", str(recipe), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "release-state.json").exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # after the first target, before the release is written
    proc.wait()
    assert not (out / "manifest.json").exists()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "outputs recorded and intact, skipped" in done.stdout
    assert json.loads((out / "manifest.json").read_text())["passed"]


def test_plot_has_one_point_per_quant_type(released):
    root, _, _ = released
    png = root / "out" / "fidelity.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot = json.loads((root / "out" / "manifest.json").read_text())["plot"]
    assert [p[0] for p in plot["points"]] == ["q4_0", "q8_0"]
    assert "fidelity.png" in (root / "out" / "README.md").read_text()


def test_push_is_one_commit_with_every_file_and_a_tag(released, monkeypatch):
    """The upload as huggingface_hub receives it (its API recorded here: no network in tests)."""
    import huggingface_hub

    from tuneport.toolkit.publish import publish, upload_plan
    from tuneport.toolkit.recipe import load_recipe

    calls = []

    class RecordingApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw["repo_id"], kw))
            return type("Commit", (), {"oid": "c0ffee", "commit_url": "https://hub/commit/c0ffee"})()

        def create_tag(self, repo_id, **kw):
            calls.append(("create_tag", repo_id, kw))

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    root, recipe, _ = released
    spec = load_recipe(recipe)[0].publish
    done = publish(root / "out", spec, dry_run=False)
    assert [c[0] for c in calls] == ["create_repo", "upload_folder", "create_tag"]
    assert calls[0][2] == {"private": True, "exist_ok": True}
    upload = calls[1][2]
    assert upload["folder_path"] == str(root / "out") and "README.md" in upload["allow_patterns"]
    assert not any(p.startswith(("release-state", ".reference")) for p in upload["allow_patterns"])
    assert calls[2][2] == {"tag": "v0.1.0", "revision": "c0ffee"}
    assert done["files"] == upload_plan(root / "out", spec)["files"] and done["commit"].endswith("c0ffee")


@pytest.mark.skipif(__import__("tuneport.convert.cpu_features", fromlist=["x"]).w4a16_cpu_problem() is not None,
                    reason="vLLM's CPU W4A16 kernel needs AVX-512")
def test_awq_target_is_released_verified_in_vllm_and_gated(inputs, tmp_path):
    from tuneport.toolkit.release import release

    recipe = write_recipe(tmp_path / "recipe.yaml", *inputs, gates="{kl: {default: 0.5}}", targets="""
  - {type: awq, group_size: 64, calib_samples: 8, calib_seqlen: 64}""")
    summary = release(recipe=recipe, out=tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    [awq] = manifest["artifacts"]
    assert summary["passed"] and awq["target"] == "awq-merge" and awq["engine"] == "vLLM" and awq["passed"]
    assert 0 < awq["metrics"]["kl"] < 0.5
    cfg = json.loads((tmp_path / "out" / "artifacts" / "awq-merge" / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 64
    assert f"{awq['metrics']['kl']:.2e}" in (tmp_path / "out" / "README.md").read_text()


def test_mlx_targets_are_released_verified_in_mlx_lm_and_gated(zoo, tmp_path, cli):
    """A q4 merge and an unquantized base + mlx-lm adapters (one with rank and alpha patterns): exported, run in
    mlx-lm against the fine-tune (tuneport's fp32 merge of both; base + each PEFT adapter), gated; a strict gate
    fails with exit 3."""
    from tuneport.toolkit.release import release

    base = zoo.base("llama")
    adapters = {"chat": zoo.adapter("llama", "plain"), "style": zoo.adapter("llama", "patterns")}
    targets = """
  - {type: mlx, quant: q4, adapters: merge}
  - {type: mlx, adapters: separate}"""
    recipe = write_recipe(tmp_path / "recipe.yaml", base, adapters, gates="{kl: {default: 0.5}, strength_error: 0.01}",
                          targets=targets)
    summary = release(recipe=recipe, out=tmp_path / "out")
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    arts = {(a["target"], a["adapter"]): a for a in manifest["artifacts"]}
    assert summary["passed"] and set(arts) == {("mlx-merge", None), ("mlx-separate", None),
                                               ("mlx-separate", "chat"), ("mlx-separate", "style")}
    assert all(a["engine"] == "mlx-lm" and a["passed"] and "kl<=0.5" in [g["gate"] for g in a["gates"]]
               for a in arts.values())
    assert 0 < arts["mlx-merge", None]["metrics"]["kl"] < 0.5  # 4-bit against the fp32 merge of both adapters
    assert arts["mlx-separate", None]["metrics"]["kl"] < 1e-6
    for name in ("chat", "style"):
        a = arts["mlx-separate", name]
        assert a["lora"] == f"artifacts/mlx-separate/adapters/{name}" and a["metrics"]["kl"] < 1e-6
        assert abs(a["metrics"]["strength"] - 1) < 1e-3
    cfg = json.loads((out / "artifacts" / "mlx-merge" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "mlx" and "mlx" in front["tags"]
    assert "python -m mlx_lm generate --model artifacts/mlx-separate --adapter-path " in card
    assert "artifacts/mlx-merge/serve-mlx.sh" in card

    strict = write_recipe(tmp_path / "strict.yaml", base, adapters, gates="{kl: 1.0e-9}", targets="""
  - {type: mlx, quant: q4}""")
    code, _, err = cli("release", strict, "--out", tmp_path / "strict-out")
    assert code == 3 and "gates failed, nothing published: artifacts/mlx-merge: kl" in err


def test_a_target_the_base_or_machine_cannot_make_fails_before_any_export(zoo, tmp_path, cli, monkeypatch):
    from tuneport.convert.errors import UserError
    from tuneport.convert.mlx import INSTALL_HINT

    def no_mlx():
        raise UserError("--target mlx needs mlx and mlx-lm (mlx is not installed)", INSTALL_HINT)

    monkeypatch.setattr("tuneport.convert.mlx.require_mlx", no_mlx)
    recipe = write_recipe(tmp_path / "r.yaml", zoo.base("llama"), {"chat": zoo.adapter("llama", "plain")},
                          targets=GGUF_ONLY + "\n  - {type: mlx, quant: q4}")
    code, _, err = cli("release", recipe, "--out", tmp_path / "out")
    assert code == 2 and err == f"error: --target mlx needs mlx and mlx-lm (mlx is not installed): {INSTALL_HINT}\n"
    assert not (tmp_path / "out" / "artifacts").exists()


# The architectures issue 18 added, each with the adapter its users train (expert LoRA on MoE bases).
NEW_ARCHS = {"gemma3": "all_linear", "gemma2": "all_linear", "mixtral": "experts", "qwen3_moe": "experts",
             "granite": "all_linear", "olmo2": "all_linear", "smollm3": "all_linear"}


@pytest.mark.parametrize("arch", list(NEW_ARCHS))
def test_every_new_architecture_is_released_and_verified(zoo, tmp_path, arch):
    """A release per architecture: the adapter as a GGUF LoRA in llama.cpp (F16 and Q8_0 bases) and as an mlx-lm
    adapter where MLX exports the architecture, each verified in its engine against base + the PEFT adapter and
    gated; F16 and the mlx-lm adapter within 1e-3 KL, Q8_0 within the default gate."""
    from tuneport.convert.support_matrix import supported
    from tuneport.toolkit.release import release
    from tuneport.toolkit.tiny import make_adapter, make_base

    if arch == "gemma3":  # every 6th layer global, as llama.cpp's Gemma 3 runs it and mlx-lm's needs a global one
        base = make_base(arch, tmp_path / "base", dims={"num_hidden_layers": 6, "sliding_window": 4,
                                                        "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
        adapter = make_adapter(base, NEW_ARCHS[arch], tmp_path / "adapter")
    else:
        base, adapter = zoo.base(arch), zoo.adapter(arch, NEW_ARCHS[arch])
    targets = "\n  - {type: gguf, quant: [f16, q8_0], adapters: separate}"
    if arch in supported("mlx"):
        targets += "\n  - {type: mlx, adapters: separate}"
    # every gate on, the tokenizer and chat template checks included (the tiny SentencePiece fixtures have no space
    # prefix, which llama.cpp runs exactly)
    recipe = write_recipe(tmp_path / "recipe.yaml", base, {"ft": adapter}, gates="{kl: {default: 0.5}}",
                          targets=targets)
    summary = release(recipe=recipe, out=tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    arts = manifest["artifacts"]
    with_lora = [a for a in arts if a["lora"]]
    print(f"\n{arch}: " + ", ".join(f"{a['engine']} {a['quant'] or ''}{' + LoRA' if a['lora'] else ''} KL "
                                    f"{a['metrics']['kl']:.1e}" for a in arts))
    assert summary["passed"] and all(a["verified"] and a["passed"] for a in arts)
    assert len(with_lora) == 2 + (arch in supported("mlx"))
    assert all(a["metrics"]["kl"] < 1e-3 for a in with_lora if a["quant"] != "q8_0")
    assert {a["engine"] for a in arts} == ({"llama.cpp", "mlx-lm"} if arch in supported("mlx") else {"llama.cpp"})


def test_an_accepted_config_key_is_an_accepted_risk_in_the_model_card(zoo, tmp_path):
    """A base whose config.json carries a key the GGUF audit refuses (read by transformers, no rule carries it):
    the recipe's accept_config_keys lets the release proceed, and the model card and manifest say so."""
    from tests_helpers import base_with_config

    from tuneport.toolkit.release import release

    base = base_with_config(zoo.base("qwen2"), tmp_path / "base", is_causal=True)
    recipe = write_recipe(tmp_path / "recipe.yaml", base, {"chat": zoo.adapter("qwen2", "plain")},
                          gates="{kl: 0.01}", targets="""
  - {type: gguf, quant: [f32], adapters: separate, accept_config_keys: [is_causal]}""")
    assert release(recipe=recipe, out=tmp_path / "out")["passed"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## Accepted risks" in card
    assert "- `gguf-separate`: is_causal = True: config key 'is_causal' = True changes what transformers' qwen2 " \
           "model computes" in card, card
