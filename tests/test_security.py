"""The gateway's security guarantees, by behaviour over HTTP against the real tiny llama.cpp engine: the admin
API's own key, keys compared whole, adapter paths confined after links are followed, and the limits on
max_tokens, prompt length and requests in flight per key (docs/serve.md, "Security")."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import tuneport

KEY, ADMIN = "inference-key-1", "admin-key-2"
MAX_TOKENS, MAX_PROMPT, PER_KEY = 8, 24, 1


@dataclass
class Secured:
    server: object
    adapter_dir: Path
    outside: Path

    def client(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, timeout=120,
                            headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture(scope="module")
def sec(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    adapters, outside = root / "adapters", root / "outside"
    adapters.mkdir()
    shutil.copytree(zoo.adapter("llama", "rslora"), adapters / "style")
    shutil.copytree(zoo.adapter("llama", "plain"), outside / "lora")
    (adapters / "escape").symlink_to(outside / "lora")  # a link in the root that leads out of it
    (adapters / "alias").symlink_to(adapters / "style")  # a link that stays inside: allowed
    sneaky = adapters / "sneaky"  # a real directory whose weights file is a link to a file outside
    sneaky.mkdir()
    shutil.copy(outside / "lora" / "adapter_config.json", sneaky)
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "lora" / "adapter_model.safetensors")
    shutil.copytree(adapters / "style", adapters / "nested")  # a link inside to a folder inside with a link out
    (adapters / "leaky").mkdir()
    (adapters / "leaky" / "secret").symlink_to(outside / "lora" / "adapter_model.safetensors")
    (adapters / "nested" / "extra").symlink_to(adapters / "leaky")
    (root / "key").write_text(KEY + "\n")
    (root / "admin").write_text(ADMIN + "\n")
    server = tuneport.serve(base=zoo.base("llama"), adapter_dir=adapters, engine="llamacpp", port=0,
                            n_ctx=128, api_key_file=root / "key", admin_key_file=root / "admin",
                            max_tokens_limit=MAX_TOKENS, max_prompt_tokens=MAX_PROMPT, max_concurrent_per_key=PER_KEY)
    yield Secured(server, adapters, outside)
    server.close()


def complete(c: httpx.Client, **kw) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": "The model", "max_tokens": 4, "temperature": 0, **kw})


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


@pytest.mark.llamacpp
def test_the_admin_api_needs_the_admin_key(sec):
    inference, admin, nobody = sec.client(), sec.client(ADMIN), sec.client(None)
    wrong = sec.client(KEY[:-1] + "x")  # as long as the real key, one character off
    load = {"name": "style2", "path": str(sec.adapter_dir / "style")}
    for c, status in ((nobody, 401), (wrong, 401), (inference, 403)):
        assert c.get("/v1/adapters").status_code == status
        r = c.post("/v1/adapters", json=load)
        assert r.status_code == status, r.text
        assert c.delete("/v1/adapters/style2").status_code == status
    r = inference.get("/v1/adapters")
    assert "admin key" in message(r) and r.json()["error"]["type"] == "permission_error"
    for spelling in ("/v1//adapters", "/v1/adapters/", "/v1/adapters//style2"):  # still the admin API
        assert inference.get(spelling).status_code == 403, spelling
    assert admin.post("/v1/adapters", json=load).status_code == 201
    assert "style2" in [a["name"] for a in admin.get("/v1/adapters").json()["adapters"]]
    assert complete(inference, model="style2").status_code == 200  # the inference key uses what admin loaded
    assert admin.delete("/v1/adapters/style2").status_code == 200


@pytest.mark.llamacpp
def test_inference_routes_need_a_key_and_take_either(sec):
    for c in (sec.client(None), sec.client("wrong"), sec.client(ADMIN + "x"), sec.client(ADMIN[:-1])):
        for r in (c.get("/v1/models"), complete(c), c.get("/health"), c.get("/metrics")):
            assert r.status_code == 401 and "API key" in message(r), r.text
    for key in (KEY, ADMIN):  # the admin key opens every route
        c = sec.client(key)
        assert c.get("/health").status_code == 200 and c.get("/v1/models").status_code == 200
        assert complete(c).status_code == 200


@pytest.mark.llamacpp
def test_adapter_paths_are_confined_after_following_links(sec):
    admin = sec.client(ADMIN)
    cases = {
        "escape": "outside the allowed roots once its links are followed",  # a linked directory leading out
        "sneaky": "holds 'adapter_model.safetensors', a link that leads outside the allowed roots",
        "nested": "holds 'extra/secret', a link that leads outside the allowed roots",
    }
    for name, reason in cases.items():
        r = admin.post("/v1/adapters", json={"name": name, "path": str(sec.adapter_dir / name)})
        assert r.status_code == 403 and reason in message(r), r.text
        r = complete(sec.client(), model=name)  # loaded on demand from --adapter-dir: the same check
        assert r.status_code == 403 and reason in message(r), r.text
    for path in (sec.outside / "lora", f"{sec.adapter_dir}/../outside/lora", f"{sec.adapter_dir}/style/../../outside"):
        r = admin.post("/v1/adapters", json={"name": "x", "path": str(path)})
        assert r.status_code == 403 and ("'..'" in message(r) or "outside the allowed roots" in message(r)), r.text
    assert complete(sec.client(), model="..").status_code in (403, 404)  # '..' is a valid name, never a way out
    r = complete(sec.client(), model="alias")  # a link that stays inside the roots is fine
    assert r.status_code == 200, r.text
    assert admin.delete("/v1/adapters/alias").status_code == 200
    assert "escape" not in [a["name"] for a in admin.get("/v1/adapters").json()["adapters"]]


@pytest.mark.llamacpp
def test_max_tokens_are_capped(sec):
    c = sec.client()
    r = complete(c, max_tokens=MAX_TOKENS + 1)
    assert r.status_code == 400 and f"'max_tokens' is {MAX_TOKENS + 1}, over this server's limit of {MAX_TOKENS} " \
        "(--max-tokens-limit)" in message(r), r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "'max_completion_tokens' is 1000" in message(r), r.text
    r = complete(c, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    r = c.post("/v1/completions", json={"prompt": "The model", "ignore_eos": True})  # none asked: the engine's 16
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS, r.text  # capped


@pytest.mark.llamacpp
def test_prompts_over_the_limit_are_refused_naming_it(sec):
    c = sec.client()
    fits = complete(c, prompt=[1] + [50] * (MAX_PROMPT - 1))
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == MAX_PROMPT, fits.text
    over = f"the prompt is {MAX_PROMPT + 1} tokens, over this server's limit of {MAX_PROMPT} (--max-prompt-tokens)"
    for r in (complete(c, prompt=[1] + [50] * MAX_PROMPT), complete(c, prompt=[[1, 50], [1] + [50] * MAX_PROMPT]),
              complete(c, prompt=[1] + [50] * MAX_PROMPT, stream=True)):
        assert r.status_code == 400 and over in message(r), r.text
    r = complete(c, prompt="The model " * 40)
    assert r.status_code == 400 and "(--max-prompt-tokens)" in message(r), r.text
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 40}]})
    assert r.status_code == 400 and "(--max-prompt-tokens)" in message(r), r.text


@pytest.mark.llamacpp
def test_requests_in_flight_are_limited_per_key(sec):
    """A request counts from its first byte until its answer ends: a body sent slowly holds its key's slot."""
    release, sent = threading.Event(), threading.Event()
    result: dict = {}

    def slow_body():
        yield b'{"prompt": "The model", '
        sent.set()
        release.wait(60)
        yield b'"max_tokens": 2, "temperature": 0}'

    def hold():
        with sec.client() as c:
            result["first"] = c.post("/v1/completions", content=slow_body(),
                                     headers={"Content-Type": "application/json"})

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert sent.wait(60)
        time.sleep(0.5)  # the headers are at the server: the request holds the key's one slot
        busy = complete(sec.client())
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1", busy.text
        assert "--max-concurrent-per-key" in message(busy) and busy.json()["error"]["type"] == "rate_limit_error"
        assert complete(sec.client(), stream=True).status_code == 429
        assert complete(sec.client(ADMIN)).status_code == 200  # another key has its own slots
        assert sec.client().get("/v1/models").status_code == 200  # only completions and chat are counted
    finally:
        release.set()
        holder.join(60)
    assert result["first"].status_code == 200, result["first"].text
    with sec.client() as c, c.stream("POST", "/v1/completions", json={"prompt": "The model", "max_tokens": 8,
                                                                     "ignore_eos": True, "stream": True}) as s:
        next(s.iter_lines())  # a client gone mid-stream gives its slot back
    deadline = time.monotonic() + 10
    while (r := complete(sec.client())).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content,reason", [
    ("", "is empty"), ("\n  \n", "is empty"), ("one\ntwo\n", "holds more than one line"), (None, "cannot read"),
    (KEY, "holds the same key as --api-key-file"), (b"\xff\xfe", "not UTF-8 text")])
def test_unusable_key_files_exit_2_before_starting(zoo, tmp_path, cli, content, reason):
    (tmp_path / "key").write_text(KEY)
    admin = tmp_path / "admin"
    if isinstance(content, bytes):
        admin.write_bytes(content)
    elif content is not None:
        admin.write_text(content)
    code, out, err = cli("serve", "--base", zoo.base("llama"), "--engine", "llamacpp", "--port", "0",
                         "--api-key-file", tmp_path / "key", "--admin-key-file", admin)
    assert code == 2 and reason in err and "--admin-key-file" in err, err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_limits_on_the_command_line(zoo, cli, tmp_path):
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--max-tokens-limit", "0", "--dry-run")
    assert code == 2 and "--max-tokens-limit" in err, err
    code, _, err = cli("serve", "--base", zoo.base("llama"), "--engine", "vllm", "--max-prompt-tokens", "64",
                       "--dry-run")
    assert code == 2 and "--max-prompt-tokens: only --engine llamacpp, mlx or exllamav3 honours it" in err, err
    (tmp_path / "admin").write_text(ADMIN)
    plan = tuneport.serve_plan(base=zoo.base("llama"), engine="llamacpp", admin_key_file=tmp_path / "admin",
                               max_tokens_limit=64, max_prompt_tokens=96, max_concurrent_per_key=4)
    argv = " ".join(plan["commands"][0]["argv"])  # the printed command keeps every guard
    for flag in ("--admin-key-file", "--max-tokens-limit 64", "--max-prompt-tokens 96", "--max-concurrent-per-key 4"):
        assert flag in argv, argv


@pytest.mark.parametrize("flag,value,message", [
    ("--max-body-bytes", "0", "--max-body-bytes must be at least 1"),
    ("--max-connections", "0", "--max-connections must be at least 1"),
    ("--body-timeout", "0", "--body-timeout must be above 0 seconds"),
    ("--header-timeout", "-1", "--header-timeout must be above 0 seconds"),
    ("--send-timeout", "nan", "--send-timeout must be above 0 seconds")])
def test_bad_http_limits_exit_2(zoo, cli, flag, value, message):
    code, out, err = cli("serve", "--base", zoo.base("llama"), "--engine", "llamacpp", flag, value, "--dry-run")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == "", err


def test_http_limits_reach_the_printed_command_and_the_server(zoo, monkeypatch):
    plan = tuneport.serve_plan(base=zoo.base("llama"), engine="llamacpp", max_body_bytes=4096, body_timeout_s=7.5,
                               max_connections=64)
    argv = " ".join(plan["commands"][0]["argv"])
    assert "--max-body-bytes 4096" in argv and "--body-timeout 7.5" in argv and "--max-connections 64" in argv
    assert "--send-timeout" not in argv  # defaults are not repeated
    from tuneport.serve.gateway.connections import ensure_file_descriptors, protocol_for, uvicorn_settings
    from tuneport.serve.limits import HttpLimits
    from tuneport.serve.options import ServeOptions

    limits = ServeOptions(base=zoo.base("llama"), max_header_bytes=2048, idle_timeout_s=3).http_limits()
    settings = uvicorn_settings(limits)
    assert settings["http"].limits is limits and settings["timeout_keep_alive"] == 3
    assert protocol_for(HttpLimits()).limits == HttpLimits()
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 2048))
    raised = []
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: raised.append(value))
    ensure_file_descriptors(HttpLimits(max_connections=1500))  # needs 1564: the soft limit is raised to the hard
    assert raised == [(2048, 2048)]
    with pytest.raises(tuneport.UserError, match="--max-connections 4000 needs 4064 open files, but this process may "
                                                 "open at most 2048"):
        ensure_file_descriptors(HttpLimits(max_connections=4000))
