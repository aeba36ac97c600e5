"""ExLlamaV3 as tuneport's engine for EXL3 without CUDA: TabbyAPI's config as TabbyAPI documents it, the
refusals `serve --engine exllamav3` gives before starting anything (adapters to TabbyAPI, no exllamav3, no CUDA),
its `--dry-run` plan (adapters in process), the in-process engine's scheduling of adapter sets, the engine policy,
and an EXL3 recipe target recorded as "not measured: needs CUDA". The engine itself runs only on CUDA
(benchmarks/gpu/exllamav3_adapters.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from safetensors.torch import load_file
from test_exl3 import cached_exl3

from tuneport.convert.exl3.tabby import CACHE_QUANTUM, DOCUMENTED_KEYS, tabby_config, write_tabby_config


@pytest.fixture(scope="module")
def exl3_model(zoo, tmp_path_factory):
    out = tmp_path_factory.mktemp("exl3-serve") / "tiny-exl3"
    shutil.copytree(cached_exl3(zoo.base("llama"), bits=2, head_bits=2), out)  # 2 bits: the fastest to encode
    return out


def test_tabby_config_uses_only_documented_keys(tmp_path):
    cfg = tabby_config(tmp_path / "models" / "my-exl3", 3000, cache_size=3000 * 4, port=5123)
    for section, values in cfg.items():
        assert set(values) <= set(DOCUMENTED_KEYS[section]), (section, values)
    assert cfg["model"] == {"model_dir": str(tmp_path / "models"), "model_name": "my-exl3", "backend": "exllamav3",
                            "max_seq_len": 3000, "cache_size": 12032, "cache_mode": "FP16"}
    assert cfg["model"]["cache_size"] % CACHE_QUANTUM == 0 and cfg["model"]["cache_size"] >= 12000
    assert cfg["network"] == {"host": "127.0.0.1", "port": 5123, "disable_auth": True, "api_servers": ["OAI"]}
    path = write_tabby_config(tmp_path / "config.yml", cfg)
    assert yaml.safe_load(path.read_text()) == cfg and path.read_text().startswith("# TabbyAPI config")
    assert tabby_config(tmp_path / "m", 256, cache_mode="8,6")["model"]["cache_mode"] == "8,6"
    with pytest.raises(ValueError, match="cache_mode"):
        tabby_config(tmp_path / "m", 256, cache_mode="Q5")


def test_serve_exllamav3_plans_adapters_in_process_and_refuses_them_on_tabby(exl3_model, zoo, cli, tmp_path):
    """Adapters are served in process (exllamav3's run-time LoRA); TabbyAPI (--tabby-dir) loads none."""
    adapter = zoo.adapter("llama", "plain")
    code, out, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--adapter", f"a={adapter}",
                         "--dry-run", "--json")
    assert code == 0, err
    r = json.loads(out)
    plan = r["plans"]["exllamav3"]
    numel = sum(t.numel() for t in load_file(str(adapter / "adapter_model.safetensors")).values())
    assert plan["adapters"] == 2 * numel and plan["total"] == plan["weights"] + plan["kv_cache"] + 2 * numel
    assert len(r["commands"]) == 1 and "TabbyAPI" not in r["commands"][0]["what"]  # no child server
    for extra in (["--adapter", f"a={adapter}"], ["--adapter-dir", str(exl3_model.parent)]):
        code, out, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--tabby-dir", tmp_path,
                             "--dry-run", *extra)
        assert code == 2 and out == "" and "Traceback" not in err
        assert "TabbyAPI (--tabby-dir) serves no LoRA adapters" in err and "drop --tabby-dir" in err
    code, _, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--engine-port", "9100", "--dry-run")
    assert code == 2 and "--engine-port and --log-file belong to TabbyAPI (--tabby-dir)" in err


def test_in_process_exllamav3_refuses_to_start_without_cuda(exl3_model, zoo, cli):
    """Here (no CUDA, no exllamav3): exit 2 with the reason, from the CLI and from the Python API."""
    from tuneport.convert.errors import UserError
    from tuneport.serve.backends.exllamav3 import ExllamaV3Backend, check_runtime

    code, out, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--adapter",
                         f"a={zoo.adapter('llama', 'plain')}")
    assert code == 2 and out == "" and "ExLlamaV3 (--engine exllamav3) is not installed here" in err, err
    assert len(err.strip().splitlines()) == 1
    for start in (check_runtime, lambda: ExllamaV3Backend(exl3_model)):
        with pytest.raises(UserError, match="ExLlamaV3 needs a CUDA GPU and this machine has none"):
            start()


def test_adapter_turns_group_requests_by_adapter_set():
    """exllamav3 applies every registered LoRA to every token: one adapter set runs at a time. The oldest waiting
    request's set goes next; its newcomers join only while no other set waits; the batch limit holds."""
    from tuneport.serve.engines.exllamav3_schedule import AdapterTurns, Waiting, adapter_set

    a, b, base = adapter_set({"a": 1.0}), adapter_set({"b": 1.0}), adapter_set({})
    assert adapter_set({"b": 0.5, "a": 1.0}) == (("a", 1.0), ("b", 0.5)) and base == ()
    turns = AdapterTurns(max_batch=3)
    reqs = [Waiting(k) for k in (a, base, a, b, a, a)]
    for r in reqs:
        turns.add(r)
    key, take = turns.admit(0)
    assert key == a and take == [reqs[0], reqs[2], reqs[4]]  # the oldest's set, up to the batch limit
    assert turns.admit(3) == (a, [])  # full
    assert turns.admit(2) == (a, [])  # base and b wait: the a batch drains, a's newcomer waits its turn
    key, take = turns.admit(0)
    assert key == base and take == [reqs[1]]
    assert turns.admit(0) == (b, [reqs[3]])
    late = Waiting(b)
    turns.pending.remove(reqs[5])
    turns.add(late)
    assert turns.admit(1) == (b, [late])  # same set, nobody else waiting: joins the running batch
    turns.add(reqs[5])
    assert turns.admit(0) == (a, [reqs[5]]) and turns.pending == []
    assert turns.switches == 4 and turns.admit(0) == (a, [])


def test_serve_exllamav3_refuses_to_start_here(exl3_model, tmp_path, cli):
    """exllamav3 is not installed on this machine: refused before anything starts; the other engines refuse EXL3."""
    code, _, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--tabby-dir", tmp_path)
    assert code == 2 and "ExLlamaV3 (--engine exllamav3) is not installed here" in err and "--tabby-dir" in err
    code, _, err = cli("serve", "--base", exl3_model, "--engine", "llamacpp")
    assert code == 2 and "serves GGUF, HF safetensors, not EXL3" in err and "--engine exllamav3" in err
    code, _, err = cli("serve", "--base", exl3_model)
    assert code == 2 and "EXL3 weights run only on ExLlamaV3, which needs a CUDA GPU" in err


def test_exllamav3_backend_checks_tabby_and_cuda(exl3_model, tmp_path):
    from tuneport.convert.errors import UserError
    from tuneport.serve.backends.exllamav3 import check_tabby, tabby_launch
    from tuneport.serve.options import ServeOptions

    with pytest.raises(UserError, match="--engine exllamav3 runs TabbyAPI, which tuneport does not ship"):
        check_tabby(ServeOptions(base=exl3_model, engine="exllamav3"))
    with pytest.raises(UserError, match="is not a TabbyAPI checkout"):
        check_tabby(ServeOptions(base=exl3_model, engine="exllamav3", tabby_dir=tmp_path))
    (tmp_path / "main.py").write_text("")
    with pytest.raises(UserError, match="ExLlamaV3 needs a CUDA GPU"):
        check_tabby(ServeOptions(base=exl3_model, engine="exllamav3", tabby_dir=tmp_path))
    assert tabby_launch(tmp_path, tmp_path / "c.yml")[1:] == ["main.py", "--config", str(tmp_path / "c.yml")]


def test_serve_exllamav3_dry_run_plans_memory_and_tabby(exl3_model, tmp_path, cli):
    code, out, err = cli("serve", "--base", exl3_model, "--engine", "exllamav3", "--tabby-dir", tmp_path,
                         "--n-ctx", "1000", "--concurrency", "4", "--port", "9000", "--dry-run", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["engine"] == "exllamav3" and list(r["plans"]) == ["exllamav3"]
    plan = r["plans"]["exllamav3"]
    weights = sum(f.stat().st_size for f in exl3_model.glob("*.safetensors"))
    assert plan["adapters"] == 0 and 0.9 * weights < plan["weights"] <= weights
    # 2 (K, V) x 2 layers x 2 KV heads x 32 head_dim x cache_size 4096 (1000 x 4 rounded up to 256) x 2 bytes
    assert plan["kv_cache"] == 2 * 2 * 2 * 32 * 4096 * 2 and "cache_size" in plan["formula"]["kv_cache"]
    tabby = r["commands"][-1]
    assert tabby["argv"] == ["python", "main.py", "--config", "TABBY_CONFIG.yml"]
    config = yaml.safe_load(tabby["what"].split("config.yml:\n", 1)[1])
    assert config["model"]["model_name"] == exl3_model.name and config["network"]["port"] == 9001
    assert r["commands"][0]["argv"][:4] == ["tuneport", "serve", "--engine", "exllamav3"]
    assert "--tabby-dir" in r["commands"][0]["argv"]


def test_release_records_exl3_as_not_measured_without_cuda(zoo, tmp_path, cli):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
name: tiny-exl3
version: 0.1.0
license: apache-2.0
base: {{path: {zoo.base('llama')}}}
adapters:
  - {{name: plain, path: {zoo.adapter('llama', 'plain')}}}
targets:
  - {{type: exl3, bits: 3.5, codebook: mcg}}
eval: {{tokens: 32}}
""")
    code, out, err = cli("release", recipe, "--out", tmp_path / "out", "--json")
    assert code == 0, err
    summary = json.loads(out)
    [entry] = summary["artifacts"]
    assert entry["not_measured"] == "not measured: needs CUDA" and not entry["verified"] and entry["passed"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "not measured: needs CUDA" in card
    assert not (tmp_path / "out" / "artifacts" / "exl3").exists()
    code, _, err = cli("release", recipe.parent / "nope.yaml")
    assert code == 2


def test_streamed_chunks_are_relabelled_whatever_the_childs_json_spacing():
    """TabbyAPI writes `"model": "x"` and `"usage": {` with spaces, and its usage rides on the last choice's
    chunk; vLLM writes compact JSON with a usage chunk of its own."""
    from tuneport.serve.backend import Usage
    from tuneport.serve.backends.upstream import UpstreamBackend

    usage = Usage()
    tabby = json.loads('{"id": "c1", "model": "tiny-exl3", "choices": [{"index": 0, "finish_reason": "stop", '
                       '"delta": {}}], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}')
    out = UpstreamBackend._relabel(tabby, "chat", usage, wants_usage=False)
    assert out["model"] == "chat" and "usage" not in out and out["choices"][0]["finish_reason"] == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    vllm = {"id": "c2", "model": "guard", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    assert UpstreamBackend._relabel(dict(vllm), "base", usage, wants_usage=False) is None
    assert UpstreamBackend._relabel(dict(vllm), "base", usage, wants_usage=True)["model"] == "base"
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 2)


def test_tabby_child_gets_no_tabby_environment(tmp_path, monkeypatch):
    """TabbyAPI's TABBY_* variables override its config file: the child starts without them."""
    import sys
    import time

    from tuneport.serve.engines.child import ChildServer

    monkeypatch.setenv("TABBY_NETWORK_PORT", "1")
    monkeypatch.setenv("TUNEPORT_KEEP", "yes")
    code = "import os; print(os.environ.get('TABBY_NETWORK_PORT'), os.environ.get('TUNEPORT_KEEP'))"
    child = ChildServer("TabbyAPI", [sys.executable, "-c", code], "http://127.0.0.1:1", tmp_path / "log",
                        unset_env_prefix="TABBY_")
    deadline = time.monotonic() + 30
    while child.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.stop()
    assert (tmp_path / "log").read_text().strip() == "None yes"


def test_gpu_check_script_fails_fast_here(tmp_path):
    """benchmarks/gpu/exllamav3_adapters.py (run on a CUDA host) says at once what this machine lacks."""
    import py_compile
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "gpu" / "exllamav3_adapters.py"
    py_compile.compile(str(script), doraise=True, cfile=str(tmp_path / "x.pyc"))
    run = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU and the exllamav3 package" in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
