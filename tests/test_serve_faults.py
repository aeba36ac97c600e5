"""Faults under `tuneport serve` (llama.cpp engine): 1,000 clients that hang up mid-stream leak nothing
(sequences, pool references, memory), and an adapter file deleted or corrupted — while it is loaded, or
before its on-demand load — is a 4xx for that adapter while the server keeps serving everything else."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

import tuneport

pytestmark = pytest.mark.slow
DISCONNECTS = 1000


@pytest.fixture(scope="module")
def srv(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    adapters = root / "adapters"
    adapters.mkdir()
    for name, variant in (("one", "plain"), ("two", "rslora"), ("three", "patterns")):
        shutil.copytree(zoo.adapter("llama", variant), adapters / name)
    server = tuneport.serve(base=zoo.base("llama"), adapter_dir=adapters, engine="llamacpp", port=0, n_ctx=128,
                            max_adapters=4)
    yield server, adapters
    server.close()


def answer(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": "The model", "max_tokens": 6, "temperature": 0})


def idle(engine) -> bool:
    """Every sequence id of every context free or held by the prompt cache; nothing decoding or waiting."""
    return not engine._pending and all(
        not cx.active and len(cx.free) + len(cx.cache) == engine.n_seq_max + engine.cache_entries
        for cx in engine._contexts)


def test_a_thousand_clients_hanging_up_mid_stream_leak_nothing(srv):
    server, _ = srv
    engine, pool = server.backend.llama, server.backend.pool
    process = psutil.Process()

    def hang_up(k: int) -> int:
        body = {"model": "one" if k % 2 else server.backend.name, "prompt": f"Story {k}:", "max_tokens": 64,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return r.status_code  # the first token arrived: hang up
        return r.status_code

    with ThreadPoolExecutor(8) as ex:
        assert set(ex.map(hang_up, range(100))) == {200}  # warm-up
        rss_warm = process.memory_info().rss
        assert set(ex.map(hang_up, range(100, 100 + DISCONNECTS))) == {200}
    with httpx.Client(base_url=server.url, timeout=60) as c:  # the server still answers whole requests
        assert answer(c, "one").status_code == 200
    deadline = time.monotonic() + 30
    while not idle(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert idle(engine)
    assert all(s["refs"] == 0 for s in pool.states())
    growth = (process.memory_info().rss - rss_warm) / rss_warm
    assert growth < 0.05, f"RSS grew {growth:.1%} over {DISCONNECTS} disconnects"


def test_an_adapter_file_deleted_or_corrupted_is_a_4xx_and_the_server_keeps_serving(srv):
    server, adapters = srv
    with httpx.Client(base_url=server.url, timeout=60) as c:
        loaded = answer(c, "two")
        assert loaded.status_code == 200
        # deleted while loaded: llama.cpp holds it, it is still served as it was
        shutil.rmtree(adapters / "two")
        again = answer(c, "two")
        assert again.status_code == 200 and again.json()["choices"] == loaded.json()["choices"]
        # corrupted before its on-demand load: 422 with the reason
        weights = adapters / "three" / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        r = answer(c, "three")
        assert r.status_code == 422 and "adapter_model.safetensors" in r.json()["error"]["message"], r.text
        # deleted before its on-demand load (unloaded first if the test above loaded it): 404
        assert c.delete("/v1/adapters/one").status_code in (200, 204, 404)
        shutil.rmtree(adapters / "one")
        r = answer(c, "one")
        assert r.status_code == 404, r.text
        # reloading the deleted one through the admin API: 4xx, and everything else still answers
        r = c.post("/v1/adapters", json={"name": "again", "path": str(adapters / "two")})
        assert 400 <= r.status_code < 500, r.text
        assert answer(c, server.backend.name).status_code == 200
        assert answer(c, "two").status_code == 200
        assert c.get("/health").status_code == 200
