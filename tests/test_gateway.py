"""The OpenAI-compatible gateway over llama.cpp: real server on loopback, the official openai client,
adapter admin, security and metrics."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import httpx
import pytest

from convert.export_hf import AdapterArg
from convert.gguf.export import export_gguf
from serve.gateway import create_app
from serve.run import build

pytestmark = pytest.mark.llamacpp
KEY = "sekret-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(zoo, tmp_path_factory):
    import uvicorn

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
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(service, api_key=KEY), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "service": service, "adapter_dir": adapter_dir, "gguf": gguf,
           "outside": root}
    srv.should_exit = True
    thread.join(timeout=30)
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
