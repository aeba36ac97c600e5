"""Engines that cannot run a model are refused before they start; an engine that dies under `tuneport serve`
is reported (its own error, one log line) and serve exits 1, or starts it again with --restart-engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests_helpers import free_port

from tuneport.serve.http import wait_for_health

pytestmark = pytest.mark.vllm
ENGINE_ARGS = ["--enforce-eager", "--max-num-seqs", "4"]


@pytest.mark.timeout(300)
def test_vllm_cpu_refuses_a_head_size_its_attention_has_no_kernel_for(tmp_path, cli):
    """Before: vLLM started, reported healthy, and its engine died at the first request ("Unsupported CPU
    attention configuration: head_dim=16"), every later request answering 502."""
    from tuneport.toolkit.tiny import make_base

    base = make_base("llama", tmp_path / "head16", dims=dict(hidden_size=64, intermediate_size=128,
                                                              num_attention_heads=4, num_key_value_heads=2))
    code, _, err = cli("serve", "--engine", "vllm", "--base", base, "--port", "0", "--max-model-len", "64")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: vLLM's CPU attention has no kernel for head size 16 (head16); it has 32, 64,"), err
    assert "serve it with --engine llamacpp" in err


def start(zoo, tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--engine", "vllm",
                             "--base", str(zoo.base("llama")), "--adapter", f"plain={zoo.adapter('llama', 'plain')}",
                             "--port", str(port), "--engine-port", str(free_port()), "--dtype", "fp32",
                             "--max-model-len", "128", "--log-file", str(tmp_path / "vllm.log"), *extra,
                             "--", *ENGINE_ARGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    assert wait_for_health(url, 600, alive=lambda: proc.poll() is None), proc.stderr.read()[-2000:]
    return proc, url


def vllm_children(proc: subprocess.Popen):
    import psutil

    return [ch for ch in psutil.Process(proc.pid).children(recursive=True)
            if "vllm" in " ".join(ch.cmdline()).lower() or ch.name().startswith("VLLM")]


def answer(url: str) -> list:
    r = httpx.post(f"{url}/v1/completions", json={"model": "plain", "prompt": "The model", "max_tokens": 4,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.timeout(600)
def test_a_dead_vllm_engine_stops_serve_with_exit_1_and_its_error(zoo, tmp_path):
    """vLLM's engine core killed behind its live API server: detected within seconds, one log line, exit 1."""
    proc, url = start(zoo, tmp_path)
    try:
        answer(url)
        core = [ch for ch in vllm_children(proc) if "api_server" not in " ".join(ch.cmdline())]
        assert core, [ch.cmdline()[:3] for ch in vllm_children(proc)]
        def load(k: int) -> int:  # traffic in flight while the engine dies: each ends, none hangs
            try:
                return httpx.post(f"{url}/v1/completions", json={"model": "plain", "prompt": f"Story {k}",
                                                                 "max_tokens": 64, "ignore_eos": True},
                                  timeout=120).status_code
            except httpx.HTTPError:
                return 0  # the server went away mid-answer

        with ThreadPoolExecutor(4) as ex:
            inflight = [ex.submit(load, k) for k in range(8)]
            time.sleep(1.0)
            t0 = time.monotonic()
            for ch in core:
                ch.send_signal(signal.SIGKILL)
            code = proc.wait(120)
            took = time.monotonic() - t0
            statuses = [f.result(timeout=120) for f in inflight]
        assert all(s in (200, 0) or s >= 500 for s in statuses), statuses
        err = proc.stderr.read()
        assert code == 1, err[-2000:]
        assert took < 60, took  # vLLM's API server notices its dead core, then /health fails for 2 s
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: the vllm engine stopped: "), err[-2000:]
        assert sum("the vllm engine stopped" in line for line in err.splitlines()) == 2  # the log line + exit
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.timeout(900)
def test_restart_engine_brings_vllm_back_with_its_adapters(zoo, tmp_path):
    proc, url = start(zoo, tmp_path, "--restart-engine")
    try:
        before = answer(url)
        server = [ch for ch in vllm_children(proc) if "api_server" in " ".join(ch.cmdline())]
        assert server
        server[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(2)
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200 and vllm_children(proc):
                    break
            except httpx.HTTPError:
                pass
        assert answer(url) == before  # the start-up adapter is served again, the same greedy answer
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    assert "the vllm engine was started again" in err, err[-2000:]
