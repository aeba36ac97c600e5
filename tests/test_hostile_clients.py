"""The hostile-client suite (tests/hostile.py) against ``tuneport serve`` as users run it (the CLI, in its own
process, so its memory is its own): every case gets the answer it must, the server's RSS grows less than 16 MiB
during any case, and the normal request after each case gets the normal answer. llama.cpp runs in the default
selection; vLLM, MLX and ``--on ray`` (tuneport's limits in Ray's own proxy) run in CI. Each run prints its table;
how fast each refusal comes is measured by benchmarks/hostile_clients.py, against vLLM's own server."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
from hostile import CASES, Case, ServeProcess, Target, normal_answer, run_case, table, warm_up
from tests_helpers import free_port

# short timeouts so that the slow-client cases end in seconds (the defaults are 60 s / 10 s / 5 s / 60 s)
TIMEOUTS = {"--body-timeout": "2", "--header-timeout": "2", "--idle-timeout": "2", "--send-timeout": "2"}
ENGINE_ARGS = {
    "llamacpp": ["--engine", "llamacpp", "--n-ctx", "256"],
    "llamacpp-h11": ["--engine", "llamacpp", "--n-ctx", "256"],
    "mlx": ["--engine", "mlx", "--n-ctx", "2048"],  # one choice per request: the long stream in one
    "vllm": ["--engine", "vllm", "--dtype", "fp32", "--max-model-len", "256", "--", "--enforce-eager",
             "--max-num-seqs", "8"],
    "ray": ["--engine", "llamacpp", "--n-ctx", "256", "--on", "ray", "--cpus-per-replica", "1"],
}
SERVERS = [pytest.param("llamacpp"),  # httptools where it is installed (it is, here)
           pytest.param("llamacpp-h11", marks=pytest.mark.slow),  # the same limits on uvicorn's other protocol
           pytest.param("vllm", marks=pytest.mark.vllm),
           pytest.param("mlx", marks=[pytest.mark.mlx, pytest.mark.slow]),
           pytest.param("ray", marks=pytest.mark.slow)]
START_S = {"llamacpp": 120, "llamacpp-h11": 120, "mlx": 300, "vllm": 900, "ray": 300}
RAY_PROCESSES = ("ProxyActor", "OpenAIIngress")  # what holds a client's bytes on Ray: the proxy and the ingress


def watched_pids(engine: str, proc: subprocess.Popen) -> list[int]:
    """The processes a client's bytes land in: ``tuneport serve``; on Ray, Ray's HTTP proxy and the ingress."""
    if engine != "ray":
        return [proc.pid]
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if any(f"ray::{name}" in line or f"ServeReplica:tuneport:{name}" in line for name in RAY_PROCESSES):
            found.append(p.pid)
    return found


@pytest.fixture(scope="module", params=SERVERS)
def target(request, zoo, tmp_path_factory):
    engine = request.param
    if engine == "ray":
        pytest.importorskip("ray")
    root = tmp_path_factory.mktemp(f"hostile-{engine}")
    args = ["--base", str(zoo.base("llama")), "--adapter", f"plain={zoo.adapter('llama', 'plain')}"]
    for flag, value in TIMEOUTS.items():
        args += [flag, value]
    engine_args = ENGINE_ARGS[engine]
    if "--" in engine_args:  # vLLM: its log, and a port of its own (not --port + 1, which may be taken)
        cut = engine_args.index("--")
        args += engine_args[:cut] + ["--log-file", str(root / "engine.log"), "--engine-port", str(free_port())]
        args += engine_args[cut:]
    else:
        args += engine_args
    env = dict(os.environ)
    if engine == "ray":  # a cluster of its own: no other Ray on this machine finds it, nor it them
        env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="tp-ray-", dir="/tmp")
    env["TUNEPORT_HTTP_PROTOCOL"] = "h11" if engine.endswith("-h11") else "auto"
    try:
        server = ServeProcess(args, free_port(), root / "serve.log", START_S[engine], env)
    except RuntimeError as e:
        pytest.fail(str(e))
    t = Target("127.0.0.1", int(server.url.rsplit(":", 1)[1]), watched_pids(engine, server.proc), server.model(),
               body_timeout_s=2, header_timeout_s=2, send_timeout_s=2, local_server=engine != "ray",
               choices=1 if engine == "mlx" else 8)
    warm_up(t)
    t.normal_answer = normal_answer(t)
    t.engine = engine  # type: ignore[attr-defined]
    t.rows = []  # type: ignore[attr-defined]
    yield t
    server.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_client(target, case: Case, summary):
    assert target.pids, "no process to watch"
    outcome = run_case(target, case)
    target.rows.append(outcome)
    summary[:] = [line for line in summary if not line.startswith(f"hostile clients, {target.engine}")]
    summary.extend(f"hostile clients, {target.engine}: {line}" for line in table("", target.rows)[1:])
    assert outcome.ok, f"{case.name}: got {outcome.got}, must get {case.expected} ({outcome.note})"
    assert outcome.next_ok, f"after {case.name}, the normal request was not answered as before"
    assert outcome.growth < case.max_growth_mb, f"{case.name}: the server grew {outcome.growth:.1f} MiB"
    if "MiB offered" in outcome.note or "MiB chunked" in case.name:  # refused while the client was still sending
        sent, offered = (float(x.split()[0]) for x in outcome.note.split(" sent of "))
        assert sent < offered / 4, outcome.note


def test_hostile_suite_leaves_the_server_answering(target):
    """After every case (the last one's connections closed), one more normal request, and /health."""
    assert normal_answer(target) == target.normal_answer
    assert httpx.get(f"http://127.0.0.1:{target.port}/health", timeout=30).status_code == 200


def test_the_page_lists_every_case():
    page = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    missing = [c.name for c in CASES if c.name not in page]
    assert not missing, f"docs/reliability.md does not list {missing}"
