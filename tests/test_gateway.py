"""The OpenAI-compatible gateway over every real backend (llama.cpp, vLLM, MLX), started through the public
API (``tuneport.serve``) and used through HTTP only: the gateway knows nothing but the Backend contract, so
every test here runs unchanged on each engine. Engine-specific checks live in test_serve_llamacpp.py,
test_serve_vllm.py and test_serve_mlx.py."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass

import httpx
import pytest

import tuneport

KEY = "sekret-key"
BACKENDS = [pytest.param("llamacpp", marks=pytest.mark.llamacpp), pytest.param("vllm", marks=pytest.mark.vllm),
            pytest.param("mlx", marks=pytest.mark.mlx)]
ENGINE_OPTIONS = {
    "llamacpp": dict(n_ctx=128, contexts=2, kv_f32=True),
    "vllm": dict(dtype="fp32", max_model_len=256, vllm_args=["--enforce-eager", "--max-num-seqs", "8"]),
    "mlx": dict(n_ctx=128),
}
BASE = "llama-fp32"  # the served name of zoo.base("llama")


@dataclass
class Gateway:
    server: object
    url: str
    adapter_dir: object
    outside: object

    def client(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"} if key else {},
                            timeout=300)


@pytest.fixture(scope="module", params=BACKENDS)
def gw(request, zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"gw-{request.param}")
    adapter_dir = root / "adapters"
    adapter_dir.mkdir()
    shutil.copytree(zoo.adapter("llama", "rslora"), adapter_dir / "rslora")
    shutil.copytree(zoo.adapter("llama", "patterns"), adapter_dir / "ondemand")
    corrupt = adapter_dir / "corrupt"
    shutil.copytree(zoo.adapter("llama", "plain"), corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json at all}")
    shutil.copytree(zoo.adapter("llama", "all_linear"), root / "outside")
    key = root / "key"
    key.write_text(KEY + "\n")
    server = tuneport.serve(base=zoo.base("llama"), adapters={"plain": zoo.adapter("llama", "plain")},
                            adapter_dir=adapter_dir, engine=request.param, max_adapters=3, port=0,
                            api_key_file=key, log_file=root / "engine.log" if request.param == "vllm" else None,
                            **ENGINE_OPTIONS[request.param])
    yield Gateway(server, server.url, adapter_dir, root / "outside")
    server.close()


def complete(c: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": "The model", "max_tokens": 6, "temperature": 0, **kw}
    return c.post("/v1/completions", json=body)


def test_auth_and_health(gw):
    assert gw.client(key=None).get("/v1/models").status_code == 401
    assert gw.client(key="wrong").get("/health").status_code == 401
    h = gw.client().get("/health").json()
    assert h["status"] == "ok" and h["model"] == BASE and h["engine"] == gw.server.backend.engine


def test_openai_client_completions_chat_streaming(gw):
    from openai import OpenAI

    oc = OpenAI(base_url=gw.url + "/v1", api_key=KEY)
    models = [m.id for m in oc.models.list().data]
    assert BASE in models and "plain" in models
    base = oc.completions.create(model=BASE, prompt="The model", max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    ad = oc.completions.create(model="plain", prompt="The model", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert base.usage.completion_tokens == 8 and base.choices[0].finish_reason == "length"
    assert base.model == BASE and ad.model == "plain"
    assert base.choices[0].text != ad.choices[0].text  # the adapter changes the answer
    stream = oc.completions.create(model="plain", prompt="The model", max_tokens=8, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ad.choices[0].text
    assert all(c.model == "plain" for c in chunks)
    chat = oc.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                      temperature=0)
    parts = oc.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, stream=True)
    assert chat.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == chat.choices[0].message.content


def test_admin_load_list_unload_and_404(gw):
    c = gw.client()
    r = c.post("/v1/adapters", json={"name": "style", "path": str(gw.adapter_dir / "rslora")})
    assert r.status_code == 201, r.text
    names = {a["name"]: a for a in c.get("/v1/adapters").json()["adapters"]}
    assert names["plain"]["pinned"] is True and "style" in names
    assert complete(c, "style").status_code == 200
    assert c.delete("/v1/adapters/style").status_code == 200
    r = complete(c, "style")
    assert r.status_code == 404 and "style" in r.json()["error"]["message"]
    r = complete(c, "style", stream=True)  # a stream is refused before it starts, with the same status
    assert r.status_code == 404 and "style" in r.json()["error"]["message"]


def test_admin_load_can_pin(gw):
    """``"pinned": true`` keeps a runtime-loaded adapter out of eviction until it is unloaded."""
    c = gw.client()
    r = c.post("/v1/adapters", json={"name": "kept", "path": str(gw.adapter_dir / "rslora"), "pinned": True})
    assert r.status_code == 201 and r.json()["pinned"] is True, r.text
    assert c.post("/v1/adapters", json={"name": "x", "path": str(gw.adapter_dir / "rslora"),
                                        "pinned": "yes"}).status_code == 400
    pool = gw.server.backend.pool
    assert complete(c, "ondemand").status_code == 200 and len(pool.states()) == pool.max_adapters
    r = c.post("/v1/adapters", json={"name": "other", "path": str(gw.adapter_dir / "rslora")})
    assert r.status_code == 201, r.text  # room made by evicting the unpinned on-demand adapter, not "kept"
    assert "kept" in pool and "ondemand" not in pool
    for name in ("other", "kept"):
        assert c.delete(f"/v1/adapters/{name}").status_code == 200 and name not in pool


def test_on_demand_load_from_adapter_dir(gw):
    c = gw.client()
    assert "ondemand" not in gw.server.backend.pool
    r = complete(c, "ondemand")
    assert r.status_code == 200, r.text
    assert "ondemand" in [m["id"] for m in c.get("/v1/models").json()["data"]]
    c.delete("/v1/adapters/ondemand")


def test_security_and_bad_adapters(gw):
    c = gw.client()
    for path, status in [(str(gw.outside), 403), (str(gw.adapter_dir / ".." / "outside"), 403)]:
        assert c.post("/v1/adapters", json={"name": "x", "path": path}).status_code == status
    assert c.post("/v1/adapters", json={"name": "bad/name", "path": "x"}).status_code == 400
    r = c.post("/v1/adapters", json={"name": "corrupt", "path": str(gw.adapter_dir / "corrupt")})
    assert r.status_code == 422 and "corrupt" in r.json()["error"]["message"], r.text
    big = c.post("/v1/completions", content=b"{" + b" " * (2 << 20) + b"}",
                 headers={"content-type": "application/json"})
    assert big.status_code == 413
    assert complete(c, "plain", max_tokens=2).status_code == 200  # still serving


def test_weighted_mixes_are_served_or_refused(gw):
    r = complete(gw.client(), BASE, adapters={"plain": 0.5}, max_tokens=2)
    if gw.server.backend.weighted_mixes:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and "weighted adapter mixes" in r.json()["error"]["message"]


def test_access_log_and_metrics(gw, caplog):
    c = gw.client()
    with caplog.at_level(logging.INFO, logger="tuneport.access"):
        r = complete(c, "plain", max_tokens=3, ignore_eos=True)
        assert r.status_code == 200
        s = c.post("/v1/completions", json={"model": "plain", "prompt": "The model", "max_tokens": 3,
                                            "temperature": 0, "ignore_eos": True, "stream": True})
        assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]")
        assert "usage" not in s.text.replace('"usage":null', "")  # the client did not ask for usage
        gw.client(key="wrong").get("/v1/models")
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tuneport.access"]
    prompt = r.json()["usage"]["prompt_tokens"]
    want = f'"POST /v1/completions" 200 model=plain prompt_tokens={prompt} completion_tokens=3 ms='
    assert sum(want in line for line in lines) == 2, lines  # the stream's line has its token counts too
    assert any('"GET /v1/models" 401 model=-' in line for line in lines), lines
    text = c.get("/metrics").text
    for name in ("tuneport_requests_total", "tuneport_completion_tokens_total", "tuneport_adapter_loads_total",
                 'tuneport_request_latency_seconds_bucket{le="+Inf"}'):
        assert name in text
    if gw.server.backend.engine == "llamacpp":  # the same prompt twice under one adapter set: one hit at least
        assert "# TYPE tuneport_prompt_cache_hits_total counter" in text and "tuneport_prompt_cache_entries " in text
        assert int(text.split("\ntuneport_prompt_cache_hits_total ")[1].split()[0]) >= 1


def test_bad_values_are_the_clients_error(gw):
    c = gw.client()
    for body in ({"max_tokens": "lots"}, {"temperature": "hot"}, {"prompt": {"not": "a prompt"}}):
        r = complete(c, "plain", **body)
        assert r.status_code == 400, (body, r.status_code, r.text)
    if gw.server.backend.engine != "vllm":  # in-process engines check what reaches their arrays
        bad = ({"prompt": [1, 100000]}, {"prompt": [1, -1]}, {"seed": -1}, {"top_p": 0}, {"temperature": -0.5})
        for body in bad:
            r = complete(c, "plain", **body)
            assert r.status_code == 400, (body, r.status_code, r.text)
        for raw in ('"temperature": NaN', '"max_tokens": Infinity'):  # JSON extensions Python's parser accepts
            r = c.post("/v1/completions", content='{"model": "plain", "prompt": "The", "max_tokens": 2, ' + raw + "}",
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
        assert complete(c, "plain").status_code == 200  # the engine is still answering


def test_every_openai_field_is_honoured_or_refused_by_name(gw):
    """n, echo, response_format, tools... : a 400 naming the field where the engine lacks it, never dropped;
    neutral values (n=1, logprobs false) ask for nothing and pass everywhere; what the table says an engine
    honours it answers."""
    from tuneport.serve.openai_fields import FIELDS

    c = gw.client()
    engine = gw.server.backend.engine
    assert complete(c, "plain", n=1, logprobs=None, echo=False, presence_penalty=0, user="u1").status_code == 200
    asks = [{"suffix": "x"}, {"n": 2}, {"echo": True}, {"logit_bias": {"5": 1}}, {"best_of": 2}, {"logprobs": 1}]
    for body in asks:
        (name,) = body
        r = complete(c, "plain", **body, temperature=1.0)  # vLLM refuses n > 1 when greedy
        if engine in FIELDS[name].engines:
            assert r.status_code == 200, (body, r.text)
        else:
            assert r.status_code == 400 and f"'{name}'" in r.json()["error"]["message"], (body, r.text)
    r = complete(c, "plain", logprobs=2)  # greedy: each token is its own top alternative, log-probabilities < 0
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == r.json()["usage"]["completion_tokens"] > 0, r.text
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value < 0 and abs(max(top.values()) - value) < 1e-5, (value, top)
    if engine != "vllm":
        r = complete(c, "plain", bogus_field=1)
        assert r.status_code == 400 and "'bogus_field'" in r.text, r.text
    for body in ({"response_format": {"type": "json_object"}},
                 {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}):
        r = c.post("/v1/chat/completions", json={"model": "plain", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, **body})
        (name,) = body
        if engine == "mlx":
            assert r.status_code == 400 and f"'{name}'" in r.text, r.text
    if engine == "llamacpp":  # the tiny llama's template renders no tools: refused with that reason
        assert r.status_code == 400 and "does not render tools" in r.text, r.text


def test_max_completion_tokens_and_stream_usage(gw):
    c = gw.client()
    r = c.post("/v1/chat/completions", json={"model": "plain", "messages": [{"role": "user", "content": "hi"}],
                                             "max_completion_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    with c.stream("POST", "/v1/completions", json={"model": "plain", "prompt": "The model", "max_tokens": 3,
                                                   "temperature": 0, "ignore_eos": True, "stream": True,
                                                   "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3, events[-1]


def test_the_compat_page_lists_every_field():
    from pathlib import Path

    from tuneport.serve.openai_fields import markdown_rows

    page = (Path(__file__).resolve().parents[1] / "docs" / "api-compat.md").read_text()
    missing = [row for row in markdown_rows() if row not in page]
    assert not missing, missing
