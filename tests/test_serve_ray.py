"""``tuneport serve --on ray`` on a local Ray cluster (2 CPUs), real llama.cpp replicas, tiny models: mixed traffic
over 6 adapters equals each adapter's fresh single-adapter llama.cpp answer, streamed or not; adapter loads with
multiplexed routing against Ray's default routing on the same traffic; admin loads reach every replica; a replica
killed mid-traffic; autoscaling from 1 to 2 replicas and back."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests_helpers import free_port, fresh_greedy

import tuneport

ray = pytest.importorskip("ray")
from tuneport.serve.options import ServeOptions  # noqa: E402
from tuneport.serve.rayserve.server import RayServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
ADAPTERS = ["plain", "all_linear", "rslora", "patterns", "regex", "layers"]
PROMPTS = [[1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5]]
N = 6
BASE = "llama-fp32-F32"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def bundle(zoo, tmp_path_factory):
    """An F32 GGUF base, the 6 adapters as GGUF LoRAs in an adapter directory (DIR/<name>/<name>.gguf), and each
    (adapter, prompt)'s greedy tokens from a fresh llama.cpp holding that adapter alone."""
    root = tmp_path_factory.mktemp("ray")
    out = root / "gguf"
    tuneport.export(base=zoo.base("llama"), adapters=[f"{n}={zoo.adapter('llama', n)}" for n in ADAPTERS],
                    target="gguf", adapter_mode="separate", quant="f32", out=out)
    adapter_dir = root / "adapters"
    for name in ADAPTERS:
        (adapter_dir / name).mkdir(parents=True)
        shutil.copy(out / "adapters" / f"{name}-F32.gguf", adapter_dir / name / f"{name}.gguf")
    model = out / f"{BASE}.gguf"
    want = {(a, i): fresh_greedy(model, adapter_dir / a / f"{a}.gguf" if a else None, p, N)
            for a in [None, *ADAPTERS] for i, p in enumerate(PROMPTS)}
    return model, adapter_dir, want


def options(bundle, **kw) -> ServeOptions:
    model, adapter_dir, _ = bundle
    kw.setdefault("max_adapters", 4)
    return ServeOptions(base=model, adapter_dir=adapter_dir, engine="llamacpp", on="ray", port=0, n_ctx=256,
                        kv_f32=True, **kw)


def ask(c: httpx.Client, adapter: str | None, prompt: list[int], stream: bool, n: int = N,
        base: str = BASE) -> tuple[int, object]:
    """(status, (token ids, text)) — or, streamed, (status, (the text, the error event that ended it or None))."""
    body = {"model": adapter or base, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = c.post("/v1/completions", json=body)
        return r.status_code, (r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["text"]) \
            if r.status_code == 200 else r.text
    text, error = "", None
    with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    text += event["choices"][0]["text"]
    return 200, (text, error)


def traffic(url: str, n: int, seed: int, concurrency: int = 8, n_tokens: int = N, base: str = BASE) -> list[tuple]:
    """``n`` requests over the base and the 6 adapters, half streamed, ``concurrency`` at a time: (adapter, prompt
    index, streamed, status, answer) each."""
    rng = random.Random(seed)
    jobs = [(rng.choice([None, *ADAPTERS]), rng.randrange(len(PROMPTS)), k % 2 == 1) for k in range(n)]
    with httpx.Client(base_url=url, timeout=120) as c, ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda j: ask(c, j[0], PROMPTS[j[1]], j[2], n_tokens, base), jobs))
    return [(*j, *a) for j, a in zip(jobs, answers, strict=True)]


def check_answers(results: list[tuple], want: dict, allow_gone: bool = False) -> int:
    """Every non-streamed 200 answer's tokens equal the reference and every stream's text the same request's
    non-streamed text; with ``allow_gone`` a request may fail with a 503 and a stream end with an error event
    (a replica killed under it). The number of such failures."""
    texts = {}
    for adapter, i, streamed, status, answer in results:
        if status == 200 and not streamed:
            tokens, text = answer
            assert tokens[:N] == want[(adapter, i)], (adapter, i, tokens)  # greedy: a longer answer's prefix
            texts[(adapter, i)] = text
    failed = 0
    for adapter, i, streamed, status, answer in results:
        if status != 200:
            assert allow_gone and status == 503, (status, answer)
            failed += 1
        elif streamed:
            text, error = answer
            if error is not None:
                assert allow_gone and error["code"] == 503, error
                failed += 1
            elif (adapter, i) in texts:
                assert text == texts[(adapter, i)], (adapter, i)
    return failed


def loads(url: str) -> dict[str, int]:
    """Adapter loads per replica, from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {line.split('"')[1]: int(line.split()[-1]) for line in text.splitlines()
            if line.startswith("tuneport_replica_adapter_loads_total{")}


def live_replicas(url: str) -> int:
    return httpx.get(f"{url}/v1/adapters").json()["replicas"]


def settle(url: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while live_replicas(url) != count:
        assert time.monotonic() < deadline, f"replicas never became {count}"
        time.sleep(0.5)


@pytest.fixture
def ray_cli_cluster(cli, bundle, tmp_path):
    """The deploy files ``tuneport serve --dry-run --on ray`` writes, and a Ray cluster started as its commands say
    (the token, ``ray start --head`` with the variables it prints; its own temporary directory, so no other Ray
    here sees it): (the dry run's report, the Serve config's path, the dashboard address, the Serve port, the
    environment ``serve deploy`` runs in)."""
    model, adapter_dir, _ = bundle
    serve_port, dashboard = free_port(), free_port()
    code, out, err = cli("serve", "--base", model, "--adapter-dir", adapter_dir, "--engine", "llamacpp", "--on",
                         "ray", "--port", serve_port, "--n-ctx", 256, "--kv-f32", "--max-adapters", 6, "--dry-run",
                         "--json", "--deploy-dir", tmp_path / "deploy")
    assert code == 0, err
    report = json.loads(out)
    token, start, deploy = report["commands"][:3]
    assert start["argv"] == ["ray", "start", "--head"] and deploy["argv"][:2] == ["serve", "deploy"]
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "ray"), *token["argv"][1:]], check=True, capture_output=True, timeout=120)
    ray_tmp = tempfile.mkdtemp(prefix="tp-ray-", dir="/tmp")  # unix socket paths must stay short
    env = {**os.environ, **start["env"], "RAY_TMPDIR": ray_tmp}
    head = subprocess.Popen([str(bin_dir / "ray"), *start["argv"][1:], "--block", "--num-cpus", "2",
                             "--disable-usage-stats", "--port", str(free_port()), "--dashboard-port", str(dashboard),
                             "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port",
                             str(free_port()), "--temp-dir", ray_tmp], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        yield report, Path(deploy["argv"][2]), address, serve_port, {**env, **deploy["env"]}
    finally:
        subprocess.run([str(bin_dir / "serve"), "shutdown", "-y", "--address", address], env=env,
                       capture_output=True, timeout=120)
        head.terminate()  # `ray start --block` stops the node's processes as it exits
        head.wait(120)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_serve_deploy_runs_the_dry_run_file_as_tuneport_serve_answers(ray_cli_cluster, bundle):
    """Ray's own CLI runs what tuneport writes: ``serve deploy`` of the dry-run ``serve_config.yaml`` on a cluster
    started with the variables the dry run prints; 120 mixed requests (base + 6 adapters, half streamed) through it
    get the answers a plain ``tuneport serve`` gives (and the fresh single-adapter llama.cpp answers); Ray's proxy
    holds tuneport's limits (the proxy callback those variables name)."""
    report, config, address, port, env = ray_cli_cluster
    _, _, want = bundle
    serve_cli = Path(sys.executable).parent / "serve"
    deadline = time.monotonic() + 120
    while True:  # the dashboard's API comes up a little after `ray start`
        done = subprocess.run([str(serve_cli), "deploy", str(config), "--address", address], env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert done.returncode == 0, done.stderr[-2000:]
    url = f"http://127.0.0.1:{port}"
    deadline, asked = time.monotonic() + 300, time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - asked > 15:  # `serve status` starts a Python that imports Ray: seconds of CPU each
            asked = time.monotonic()
            status = subprocess.run([str(serve_cli), "status", "--address", address], env=env,
                                    capture_output=True, text=True).stdout
            assert "DEPLOY_FAILED" not in status, status
        assert time.monotonic() < deadline, "the deployment never became healthy"
        time.sleep(0.5)
    through_ray = traffic(url, 120, seed=3)
    assert check_answers(through_ray, want) == 0
    model, adapter_dir, _ = bundle
    with tuneport.serve(base=model, adapter_dir=adapter_dir, engine="llamacpp", port=0, n_ctx=256, kv_f32=True,
                        max_adapters=6) as plain:
        direct = traffic(plain.url, 120, seed=3)
    assert [r[:4] for r in through_ray] == [r[:4] for r in direct]
    assert [r[4] for r in through_ray] == [r[4] for r in direct]  # token ids and texts, streamed or not
    # tuneport's limits in Ray's proxy: the head's headers and a chunked body counted as it arrives
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nX-Filler: {'a' * 65536}\r\n\r\n".encode())
        assert sock.recv(64).startswith(b"HTTP/1.1 431"), "Ray's proxy does not hold --max-header-bytes"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(64):  # 4 MiB offered, the limit 1 MiB
                sock.sendall(b"10000\r\n" + b"a" * 65536 + b"\r\n")
        except OSError:
            pass
        assert sock.recv(64).startswith(b"HTTP/1.1 413")


def test_mixed_traffic_on_two_replicas_routes_each_adapter_to_its_replica(cluster, bundle):
    """210 requests (base + 6 adapters, half streamed) at concurrency 8 on 2 replicas of --max-adapters 6: every
    answer equals the fresh single-adapter llama.cpp answer; with multiplexed routing adapter loads stay within 1.5x
    the adapters, against Ray's default routing on the same traffic (each replica loading every busy adapter). With
    4 slots a replica Ray gave 5 new adapters to thrashed once (16 loads): Ray places an adapter no replica holds by
    queue length, not by free slots."""
    _, _, want = bundle
    with RayServer(options(bundle, replicas=2, max_adapters=6)) as server:
        settle(server.url, 2)
        results = traffic(server.url, 210, seed=1)
        assert check_answers(results, want) == 0
        time.sleep(1.5)  # one report more
        routed = loads(server.url)
    with RayServer(options(bundle, replicas=2, max_adapters=6), multiplex=False) as server:
        settle(server.url, 2)
        assert check_answers(traffic(server.url, 210, seed=1), want) == 0
        time.sleep(1.5)
        unrouted = loads(server.url)
    print(f"adapter loads, 6 adapters, 2 replicas x 6 slots, 210 requests: multiplexed {sum(routed.values())} "
          f"{routed}, Ray's default routing {sum(unrouted.values())} {unrouted}")
    assert len(routed) == 2 and sum(routed.values()) <= 1.5 * len(ADAPTERS)
    assert sum(unrouted.values()) > sum(routed.values())


def test_admin_loads_reach_every_replica_and_a_killed_replica_is_replaced(cluster, bundle, tmp_path):
    """An admin load (a path outside --adapter-dir refused, one inside loaded) lands on both replicas, an unload
    leaves both; then a replica's actor is killed mid-traffic: no wrong answer, in-flight requests retried or
    refused with a 503, Ray starts a new replica and it serves adapters again."""
    model, adapter_dir, want = bundle
    extra = adapter_dir / "extra"
    shutil.copytree(adapter_dir / "plain", extra)
    with RayServer(options(bundle, replicas=2)) as server:
        settle(server.url, 2)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/adapters", json={"name": "outside", "path": str(tmp_path)})
            assert r.status_code == 403, r.text
            r = c.post("/v1/adapters", json={"name": "copy", "path": str(extra), "pinned": True})
            assert r.status_code == 201 and len(r.json()["replicas"]) == 2, r.text
            listed = {a["name"]: a for a in c.get("/v1/adapters").json()["adapters"]}
            assert len(listed["copy"]["replicas"]) == 2 and "copy" in [m["id"] for m in c.get("/v1/models").json()
                                                                          ["data"]]
            assert ask(c, "copy", PROMPTS[0], False)[1][0] == want[("plain", 0)]
            assert c.post("/v1/adapters", json={"name": "copy", "path": str(extra)}).status_code == 409
            assert c.delete("/v1/adapters/copy").status_code == 200
            assert "copy" not in {a["name"] for a in c.get("/v1/adapters").json()["adapters"]}
            assert c.post("/v1/completions", json={"model": "copy", "prompt": [1], "max_tokens": 1}).status_code == 404

        check_fields_pass_through(server.url, bundle)
        before = set(loads(server.url))
        victim = sorted(before)[0]
        results: list = []
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(traffic, server.url, 120, 2, 8, 24)
            time.sleep(2.0)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::tuneport#AdapterReplica#{victim}", namespace="serve"),
                     no_restart=True)
            results = running.result()
        failed = check_answers(results, want, allow_gone=True)
        deadline = time.monotonic() + 90
        while not (len(now := set(loads(server.url))) == 2 and victim not in now):
            assert time.monotonic() < deadline, "Ray never replaced the killed replica"
            time.sleep(1)
        print(f"replica killed under 120 requests: {failed} failed cleanly (503), the rest answered right")
        assert check_answers(traffic(server.url, 42, seed=3), want) == 0  # the new replica serves too


FIELD_BODIES = [
    ("completions", {"model": "plain", "prompt": [1, 50, 60], "max_tokens": 5, "temperature": 0, "logprobs": 2,
                     "n": 2}),
    ("completions", {"model": "rslora", "prompt": [1, 9, 8], "max_tokens": 5, "temperature": 0.8, "seed": 7,
                     "stream": True, "stream_options": {"include_usage": True}}),
    ("chat/completions", {"model": "regex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                          "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                      "required": ["a"]}}}}),
    ("chat/completions", {"model": "layers", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 16,
                          "temperature": 0, "tools": [{"type": "function", "function": {
                              "name": "weather", "parameters": {"type": "object", "properties": {}}}}],
                          "tool_choice": "required"}),
    ("completions", {"model": "plain", "prompt": [1], "max_tokens": 2, "frequency_penalty": "x"}),
]


def _comparable(r: httpx.Response) -> tuple[int, object]:
    """A response without what differs between any two servers (ids, timestamps)."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return r.status_code, [{k: v for k, v in e.items() if k not in ("id", "created")} for e in events]
    body = r.json()
    return r.status_code, {k: v for k, v in body.items() if k not in ("id", "created")}


def check_fields_pass_through(url: str, bundle) -> None:
    """logprobs, n, sampling with a seed, streamed usage, JSON schema, tools and a refused field: the answer
    through Ray equals ``tuneport serve``'s without Ray, byte for byte but ids and timestamps."""
    model, adapter_dir, _ = bundle
    with tuneport.serve(base=model, adapter_dir=adapter_dir, engine="llamacpp", max_adapters=4, port=0, n_ctx=256,
                        kv_f32=True) as direct, httpx.Client(timeout=60) as c:
        for route, body in FIELD_BODIES:
            got, want = (_comparable(c.post(f"{u}/v1/{route}", json=body)) for u in (url, direct.url))
            assert got == want, (route, body, got, want)
        assert want[0] == 400  # the last one: refused alike


def test_autoscaling_from_one_replica_to_two_and_back(cluster, bundle):
    """--min-replicas 1 --max-replicas 2 --target-ongoing-requests 1: load at concurrency 8 adds the second
    replica, answers stay right throughout, and idle it goes back to one."""
    _, _, want = bundle
    opts = options(bundle, min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1,
                   downscale_delay_s=3)
    with RayServer(opts) as server:
        settle(server.url, 1)
        seen, t0 = 1, time.monotonic()
        while seen < 2:
            assert time.monotonic() - t0 < 120, "never scaled up"
            assert check_answers(traffic(server.url, 48, seed=int(time.monotonic()), n_tokens=24), want) == 0
            seen = live_replicas(server.url)
        up = time.monotonic() - t0
        settle(server.url, 1, timeout=90)
        print(f"autoscaling: 2 replicas after {up:.0f} s of load, back to 1 within {time.monotonic() - t0 - up:.0f} s")


@pytest.mark.vllm
def test_vllm_replicas_serve_mixed_traffic_equal_to_peft(cluster, zoo, tmp_path):
    """The same application over the vLLM engine (fp32, CPU): 2 replicas of one vLLM server each, 56 mixed
    requests (base + 6 PEFT adapters from --adapter-dir, half streamed) equal to transformers + PEFT greedy, adapter
    loads within 1.5x the adapters."""
    from tuneport.toolkit.fidelity import greedy, load_hf, load_peft

    base = zoo.base("llama")
    adapter_dir = tmp_path / "adapters"
    for name in ADAPTERS:
        shutil.copytree(zoo.adapter("llama", name), adapter_dir / name)
    want = {(None, i): greedy(load_hf(base), p, N) for i, p in enumerate(PROMPTS)}
    for name in ADAPTERS:
        model = load_peft(base, zoo.adapter("llama", name))
        want.update({(name, i): greedy(model, p, N) for i, p in enumerate(PROMPTS)})
    opts = ServeOptions(base=base, adapter_dir=adapter_dir, engine="vllm", on="ray", replicas=2, max_adapters=6,
                        max_lora_rank=16, dtype="fp32", max_model_len=256, port=0,
                        vllm_args=["--enforce-eager", "--max-num-seqs", "16"], log_file=tmp_path / "vllm.log")
    with RayServer(opts) as server:
        settle(server.url, 2, timeout=300)
        results = traffic(server.url, 56, seed=5, base="llama-fp32")
        assert check_answers(results, want) == 0
        time.sleep(1.5)
        routed = loads(server.url)
    print(f"vLLM on Ray: adapter loads {sum(routed.values())} {routed}")
    assert len(routed) == 2 and sum(routed.values()) <= 1.5 * len(ADAPTERS)


def test_the_scale_out_page_example_runs(cluster, zoo, tmp_path, monkeypatch):
    """docs/scale-out.md's Python example, as written, in a directory laid out as it says: every model's answer
    equals the one ``tuneport serve`` gives without Ray."""
    import contextlib
    import io
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "scale-out.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    adapters = {"chat": zoo.adapter("llama", "all_linear"), "style": zoo.adapter("llama", "rslora")}
    tuneport.export(base=zoo.base("llama"), adapters=[f"{n}={p}" for n, p in adapters.items()], target="gguf",
                    adapter_mode="separate", quant="q8_0", out=tmp_path / "export")
    (tmp_path / "gguf").mkdir()
    shutil.copy(next((tmp_path / "export").glob("*-Q8_0.gguf")), tmp_path / "gguf" / "base-Q8_0.gguf")
    for name in adapters:
        (tmp_path / "adapters" / name).mkdir(parents=True)
        lora = next((tmp_path / "export" / "adapters").glob(f"{name}-*.gguf"))
        shutil.copy(lora, tmp_path / "adapters" / name / lora.name)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example, "docs/scale-out.md", "exec"), {})  # noqa: S102 - our own documentation
    out = printed.getvalue()
    assert "2 replicas" in out
    answers = dict(re.findall(r"^(chat|style|base-Q8_0) ('.*')$", out, flags=re.M))
    assert len(set(answers.values())) == 3, out  # three different models answered
    with tuneport.serve(base="gguf/base-Q8_0.gguf", adapter_dir="adapters", max_adapters=4, n_ctx=256,
                        port=0) as direct:
        for model, answer in answers.items():
            r = httpx.post(f"{direct.url}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
            assert repr(r.json()["choices"][0]["text"]) == answer, model
