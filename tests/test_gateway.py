"""The OpenAI-compatible gateway over llama.cpp: real server on loopback, the official openai client,
adapter admin, security and metrics."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest
from tests_helpers import Running, free_port

from convert.export_hf import AdapterArg
from convert.gguf.export import export_gguf
from serve.gateway import create_app
from serve.http import wait_for_health
from serve.run import build

pytestmark = pytest.mark.llamacpp
KEY = "sekret-key"


@pytest.fixture(scope="module")
def server(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("gw")
    gguf = root / "gguf"
    export_gguf(zoo.base("llama"), [AdapterArg(zoo.adapter("llama", v), name=v) for v in ("plain", "rslora")],
                gguf, mode="separate", quant="f32")
    adapter_dir = root / "adapters"
    adapter_dir.mkdir()
    shutil.copy(gguf / "adapters" / "rslora-F32.gguf", adapter_dir / "rslora.gguf")
    (adapter_dir / "ondemand").mkdir()
    shutil.copy(gguf / "adapters" / "rslora-F32.gguf", adapter_dir / "ondemand" / "adapter.gguf")
    (adapter_dir / "corrupt").mkdir()
    (adapter_dir / "corrupt" / "adapter.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    shutil.copytree(zoo.adapter("llama", "all_linear"), adapter_dir / "peft_all_linear")
    service = build(str(gguf / "llama-fp32-F32.gguf"), [f"plain={gguf / 'adapters' / 'plain-F32.gguf'}"],
                    adapter_dir, max_adapters=3, pin=True, n_ctx=128, workers=2, kv_f32=True)
    run = Running(create_app(service, api_key=KEY))
    yield {"url": run.url, "service": service, "adapter_dir": adapter_dir, "gguf": gguf, "outside": root}
    run.stop()
    service.close()


def client(server, key=KEY):
    return httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {key}"} if key else {},
                        timeout=60)


def test_auth(server):
    assert client(server, key=None).get("/v1/models").status_code == 401
    assert client(server, key="wrong").get("/health").status_code == 401
    assert client(server).get("/health").json()["status"] == "ok"


def test_openai_client_completions_chat_streaming(server):
    from openai import OpenAI

    oc = OpenAI(base_url=server["url"] + "/v1", api_key=KEY)
    models = [m.id for m in oc.models.list().data]
    assert "llama-fp32-F32" in models and "plain" in models
    base = oc.completions.create(model="llama-fp32-F32", prompt="The model", max_tokens=8, temperature=0)
    ad = oc.completions.create(model="plain", prompt="The model", max_tokens=8, temperature=0)
    assert base.usage.completion_tokens == 8 and base.choices[0].finish_reason == "length"
    assert base.choices[0].text != ad.choices[0].text  # the adapter changes the answer
    stream = oc.completions.create(model="plain", prompt="The model", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == ad.choices[0].text
    chat = oc.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                      temperature=0)
    parts = oc.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content


def test_admin_load_list_unload_and_404(server):
    c = client(server)
    r = c.post("/v1/adapters", json={"name": "style", "path": str(server["adapter_dir"] / "rslora.gguf")})
    assert r.status_code == 201, r.text
    names = {a["name"]: a for a in c.get("/v1/adapters").json()["adapters"]}
    assert names["plain"]["pinned"] is True and "style" in names
    assert c.post("/v1/completions", json={"model": "style", "prompt": "x", "max_tokens": 2}).status_code == 200
    assert c.delete("/v1/adapters/style").status_code == 200
    r = c.post("/v1/completions", json={"model": "style", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and "style" in r.json()["error"]["message"]


def test_on_demand_and_peft_conversion(server):
    c = client(server)
    r = c.post("/v1/completions", json={"model": "ondemand", "prompt": "The model", "max_tokens": 4})
    assert r.status_code == 200, r.text
    r = c.post("/v1/completions", json={"model": "peft_all_linear", "prompt": "The model", "max_tokens": 4})
    assert r.status_code == 422  # a GGUF base cannot convert PEFT dirs: needs the HF base
    assert "HF base" in r.json()["error"]["message"]


def test_security_and_bad_adapters(server):
    c = client(server)
    for path, status in [(str(server["outside"] / "gguf" / "adapters" / "rslora-F32.gguf"), 403),
                         (str(server["adapter_dir"] / ".." / "gguf" / "adapters" / "rslora-F32.gguf"), 403)]:
        assert c.post("/v1/adapters", json={"name": "x", "path": path}).status_code == status
    assert c.post("/v1/adapters", json={"name": "bad/name", "path": "x"}).status_code == 400
    r = c.post("/v1/adapters", json={"name": "corrupt", "path": str(server["adapter_dir"] / "corrupt")})
    assert r.status_code == 422, r.text
    big = c.post("/v1/completions", content=b"{" + b" " * (2 << 20) + b"}",
                 headers={"content-type": "application/json"})
    assert big.status_code == 413
    assert c.post("/v1/completions", json={"model": "plain", "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_metrics(server):
    text = client(server).get("/metrics").text
    assert "tuneport_requests_total" in text and "tuneport_adapter_loads_total" in text
    assert 'tuneport_request_latency_seconds_bucket{le="+Inf"}' in text


def test_mixed_load_matches_fresh_instances_and_peft(server, zoo):
    """200 greedy requests mixing the base and 3 adapters at concurrency 8."""
    from concurrent.futures import ThreadPoolExecutor

    from tests_helpers import fresh_greedy

    from toolkit.fidelity import greedy, load_peft

    c = client(server)
    gguf = server["gguf"]
    extra = {"all_linear": zoo.adapter("llama", "all_linear")}
    export_gguf(zoo.base("llama"), [AdapterArg(extra["all_linear"], name="all_linear")], gguf.parent / "g2",
                mode="separate", quant="f32")
    lora_files = {"plain": gguf / "adapters" / "plain-F32.gguf", "rslora": gguf / "adapters" / "rslora-F32.gguf",
                  "all_linear": gguf.parent / "g2" / "adapters" / "all_linear-F32.gguf"}
    shutil.copy(lora_files["all_linear"], server["adapter_dir"] / "all_linear.gguf")
    assert c.post("/v1/adapters", json={"name": "all_linear",
                                        "path": str(server["adapter_dir"] / "all_linear.gguf")}).status_code == 201
    assert c.post("/v1/adapters", json={"name": "rslora",
                                        "path": str(server["adapter_dir"] / "rslora.gguf")}).status_code == 201
    prompts = [[1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5], [1, 100], [1, 33, 44]]
    model = gguf / "llama-fp32-F32.gguf"
    names = [None, "plain", "all_linear", "rslora"]
    want = {(n, i): fresh_greedy(model, lora_files.get(n), p, 16) for n in names for i, p in enumerate(prompts)}
    for n in names[1:]:
        peft_model = load_peft(zoo.base("llama"), zoo.adapter("llama", n))
        for i, p in enumerate(prompts):
            assert want[(n, i)][:8] == greedy(peft_model, p, 8), (n, i)
    jobs = [(names[k % 4], (k // 4) % len(prompts)) for k in range(200)]

    def ask(job):
        n, i = job
        r = c.post("/v1/completions", json={"model": n or "llama-fp32-F32", "prompt": prompts[i], "max_tokens": 16,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(ask, jobs))
    bad = [(j, r) for j, r in zip(jobs, results, strict=True) if r[0] != 200 or r[1] != want[j]]
    assert not bad, bad[:2]
    c.delete("/v1/adapters/all_linear")
    c.delete("/v1/adapters/rslora")


def test_churn_with_two_slots_and_five_adapters(zoo, tmp_path):
    """--max-adapters 2, 5 adapters loaded on demand, evicted and unloaded under traffic: 0 wrong, no 5xx."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from tests_helpers import fresh_greedy

    variants = ["plain", "all_linear", "rslora", "patterns", "regex"]
    gguf = tmp_path / "gguf"
    export_gguf(zoo.base("llama"), [AdapterArg(zoo.adapter("llama", v), name=v) for v in variants], gguf,
                mode="separate", quant="f32")
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    for v in variants:
        (adapter_dir / v).mkdir()
        shutil.copy(gguf / "adapters" / f"{v}-F32.gguf", adapter_dir / v / "adapter.gguf")
    model = gguf / "llama-fp32-F32.gguf"
    prompts = [[1, 50, 60, 70], [1, 9, 8, 7]]
    want = {(v, i): fresh_greedy(model, gguf / "adapters" / f"{v}-F32.gguf", p, 8)
            for v in variants for i, p in enumerate(prompts)}
    service = build(str(model), [], adapter_dir, max_adapters=2, pin=True, n_ctx=64, workers=2, kv_f32=True)
    run = Running(create_app(service))
    try:
        c = httpx.Client(base_url=run.url, timeout=120)
        stop = threading.Event()

        def admin():
            rng = random.Random(0)
            while not stop.is_set():
                c.delete(f"/v1/adapters/{rng.choice(variants)}")  # 200, 404 (not loaded) or 409 (in use)
                time.sleep(0.01)

        def ask(k):
            v, i = variants[k % 5], k % 2
            r = c.post("/v1/completions", json={"model": v, "prompt": prompts[i], "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})
            return (v, i), r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)

        admin_thread = threading.Thread(target=admin)
        admin_thread.start()
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(ask, range(120)))
        stop.set()
        admin_thread.join()
        bad = [r for r in results if r[1] != 200 or r[2] != want[r[0]]]
        assert not bad, bad[:3]
        assert service.pool.stats.evictions > 0 and len(service.pool.names()) <= 2
        r = c.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404
    finally:
        run.stop()
        service.close()


def test_tuneport_serve_cli_starts_answers_and_stops_on_sigterm(zoo, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    gguf = tmp_path / "gguf"
    export_gguf(zoo.base("llama"), [AdapterArg(zoo.adapter("llama", "plain"), name="plain")], gguf,
                mode="separate", quant="f32")
    key = tmp_path / "key"
    key.write_text("k1\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "serve", "--base", str(gguf / "llama-fp32-F32.gguf"),
                             "--adapter", f"plain={gguf / 'adapters' / 'plain-F32.gguf'}", "--port", str(port),
                             "--api-key-file", str(key), "--n-ctx", "64", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer k1"}, timeout=30)
        wait_for_health(f"http://127.0.0.1:{port}", 30, headers={"Authorization": "Bearer k1"}, interval_s=0.1)
        r = c.post("/v1/completions", json={"model": "plain", "prompt": "The model", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


def test_serve_bad_input_exits_2(tmp_path, cli):
    code, _, err = cli("serve", "--base", tmp_path / "nope.gguf")
    assert code == 2 and "nope.gguf does not exist" in err
    code, _, err = cli("serve", "--base", tmp_path / "nope.gguf", "--engine", "llamacpp")
    assert code == 2 and "neither a GGUF file nor a model directory" in err
    code, _, err = cli("serve", "--base", tmp_path / "x.gguf", "--engine", "vllm")
    assert code == 2 and "not GGUF" in err and "--engine llamacpp" in err
    code, _, err = cli("serve", "--base", tmp_path / "x.gguf", "--engine", "exllamav3")
    assert code == 2 and "not served by this version" in err
    code, _, err = cli("serve", "--base", tmp_path / "x.gguf", "--engine", "llamacpp", "--", "--enforce-eager")
    assert code == 2 and "are for vLLM" in err


def test_hf_base_and_peft_adapters_are_converted_and_cached(zoo, tmp_path, monkeypatch):
    """--base HF_DIR is converted once to GGUF; PEFT adapter dirs are converted on load, cached by content."""
    from fastapi.testclient import TestClient

    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    shutil.copytree(zoo.adapter("llama", "rslora"), adapter_dir / "style")
    service = build(str(zoo.base("llama")), [f"chat={zoo.adapter('llama', 'plain')}"], adapter_dir,
                    max_adapters=4, pin=True, n_ctx=64, workers=1)
    try:
        c = TestClient(create_app(service))
        body = {"prompt": [1, 50, 60, 70], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        outs = {m: c.post("/v1/completions", json={**body, "model": m}).json()["choices"][0]["token_ids"]
                for m in (service.name, "chat", "style")}
        assert len({tuple(v) for v in outs.values()}) == 3  # base and each adapter answer differently
        assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
        assert len(list((tmp_path / "cache" / "loras").glob("*.gguf"))) == 2
    finally:
        service.close()
    again = build(str(zoo.base("llama")), [], adapter_dir, max_adapters=4, pin=True, n_ctx=64, workers=1)
    again.close()
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1  # reused, not converted again
