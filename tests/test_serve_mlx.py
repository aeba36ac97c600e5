"""The MLX engine (`tuneport serve --engine mlx`): many adapters over one base model in memory, requests for
different adapters decoded in one batch, each answer equal to mlx-lm running that adapter alone (mlx-lm's
own loader and LoRA layers over the same MLX base); runtime load/unload; memory = base + adapters; bad
adapters refused with the reason; MLX directories (quantized too) served as they are."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests_helpers import free_port

import tuneport
from tuneport.serve.http import wait_for_health

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

NAMES = [None, "plain", "all_linear", "rslora", "dora"]  # None: the base
PROMPTS = [[1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5], [1, 100], [1, 33, 44]]
N = 16


def mlx_lm_greedy(model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens per prompt from mlx-lm itself: its loader, its LoRA layers, one adapter, one request."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)] for p in prompts]


def mlx_lm_adapter(zoo, variant: str, out: Path, wide: bool = False) -> Path:
    """The zoo's PEFT adapter as an mlx-lm adapter directory (tuneport's converter, checked against PEFT by
    test_mlx_export)."""
    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.convert.mlx.adapters import mlx_adapter, write_mlx_adapter

    peft, base = zoo.adapter("llama", variant, wide=wide), zoo.base("llama", wide=wide)
    write_mlx_adapter(mlx_adapter(load_adapter(peft), Checkpoint(base)), out)
    return out


def ask(c: httpx.Client, model: str, prompt: list[int], n: int = N, **kw) -> tuple[int, object]:
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                        "ignore_eos": True, "return_token_ids": True, **kw})
    return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.json()


@pytest.fixture(scope="module")
def mlx_base(zoo) -> Path:
    """The MLX LM directory the engine serves for zoo.base("llama") (converted once, cached)."""
    from tuneport.serve.backends.mlx import cached_mlx

    return cached_mlx(zoo.base("llama"), "auto")


@pytest.fixture(scope="module")
def reference(zoo, mlx_base, tmp_path_factory) -> dict:
    """mlx-lm's greedy tokens per (adapter, prompt): each adapter alone in its own mlx-lm model."""
    root = tmp_path_factory.mktemp("mlx-ref")
    want = {}
    for name in NAMES:
        adapter = mlx_lm_adapter(zoo, name, root / name) if name else None
        for i, toks in enumerate(mlx_lm_greedy(mlx_base, adapter, PROMPTS, N)):
            want[(name, i)] = toks
    return want


@pytest.mark.slow  # the default run's budget (4 minutes on 2 cores): runs in the full suite (make test)
def test_mixed_adapters_at_concurrency_8_match_mlx_lm_alone(zoo, reference):
    """100 greedy requests (base + 4 adapters, DoRA included) at concurrency 8 through the gateway: every answer
    equals mlx-lm's with only that adapter; adapters share decode steps and the base is never reloaded."""
    adapters = {n: str(zoo.adapter("llama", n)) for n in NAMES[1:]}
    jobs = [(NAMES[k % 5], (k // 5) % len(PROMPTS)) for k in range(100)]
    with tuneport.serve(base=zoo.base("llama"), adapters=adapters, engine="mlx", port=0, n_ctx=128) as server:
        engine = server.backend.mlx
        model = engine.model
        c = httpx.Client(base_url=server.url, timeout=120)
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda j: ask(c, j[0] or server.backend.name, PROMPTS[j[1]]), jobs))
        assert engine.model is model  # one base model the whole time
        assert engine.max_batch_adapters >= 3  # different adapters decoded in the same forward
    bad = [(j, g) for j, g in zip(jobs, got, strict=True) if g != (200, reference[j])]
    assert not bad, bad[:2]


def test_every_variant_mlx_expresses_matches_mlx_lm(zoo, tmp_path, mlx_base):
    """Rank/alpha patterns, a layer subset, regex targets and embedding LoRA, PEFT dirs and mlx-lm dirs alike."""
    variants = ["patterns", "layers", "regex", "embedding"]
    want = {v: mlx_lm_greedy(mlx_base, mlx_lm_adapter(zoo, v, tmp_path / v), PROMPTS[:2], 8) for v in variants}
    adapters = {v: str(zoo.adapter("llama", v)) for v in variants}
    adapters.update({f"{v}-mlx": str(tmp_path / v) for v in variants})
    with tuneport.serve(base=zoo.base("llama"), adapters=adapters, engine="mlx", port=0, n_ctx=64,
                        max_adapters=8) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        with ThreadPoolExecutor(8) as ex:
            jobs = [(name, i) for name in adapters for i in range(2)]
            got = dict(zip(jobs, ex.map(lambda j: ask(c, j[0], PROMPTS[j[1]], 8), jobs), strict=True))
    bad = {j: g for j, g in got.items() if g != (200, want[j[0].removesuffix("-mlx")][j[1]])}
    assert not bad, bad


def test_runtime_load_unload_and_memory_is_base_plus_adapters(zoo, tmp_path, reference):
    """Adapters loaded and unloaded through the admin API while the base stays; the engine's memory grows by
    the adapters' stacks (not by a model per adapter) and shrinks back when they go."""
    from tuneport.serve.policy import adapter_nbytes

    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    for n in NAMES[1:4]:
        shutil.copytree(zoo.adapter("llama", n), adapter_dir / n)
    with tuneport.serve(base=zoo.base("llama"), adapter_dir=adapter_dir, engine="mlx", port=0, n_ctx=64) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        before = c.get("/health").json()
        gc.collect()  # MLX counts every live array of this process: drop earlier tests' models first
        info = server.backend.describe()
        base_bytes, active0 = info["base_bytes"], info["mlx_active_bytes"]
        assert before["adapters"] == 0 and info["adapter_bytes"] == 0
        assert base_bytes == 426_624 * 4 and active0 >= base_bytes  # the fp32 tiny llama, once

        served = {f"x-{n}": n for n in NAMES[1:4]}  # names with no directory of their own: no on-demand reload
        for name, n in served.items():
            r = c.post("/v1/adapters", json={"name": name, "path": str(adapter_dir / n)})
            assert r.status_code == 201, r.text
            assert r.json()["bytes"] == adapter_nbytes(adapter_dir / n, "mlx")
            assert ask(c, name, PROMPTS[0]) == (200, reference[(n, 0)])
        gc.collect()
        info = server.backend.describe()
        loaded = sum(adapter_nbytes(adapter_dir / n, "mlx") for n in NAMES[1:4])
        stacks = info["adapter_bytes"]
        assert loaded <= stacks <= 3 * loaded  # zero slot 0 and rank padding on top of the adapters themselves
        grown = info["mlx_active_bytes"] - active0
        assert 0.9 * stacks <= grown <= stacks + loaded and grown < base_bytes  # not a model per adapter
        gauges = c.get("/metrics").text
        assert f"tuneport_adapter_bytes {stacks}\n" in gauges and f"tuneport_base_bytes {base_bytes}\n" in gauges
        assert ask(c, server.backend.name, PROMPTS[1]) == (200, reference[(None, 1)])

        assert c.delete("/v1/adapters/x-all_linear").status_code == 200
        for stream in (False, True):
            r = c.post("/v1/completions", json={"model": "x-all_linear", "prompt": "x", "max_tokens": 2,
                                                "stream": stream})
            assert r.status_code == 404 and "'x-all_linear' is not loaded" in r.json()["error"]["message"]
        assert ask(c, "x-rslora", PROMPTS[2]) == (200, reference[("rslora", 2)])  # the others are untouched
        for name in ("x-plain", "x-rslora"):
            assert c.delete(f"/v1/adapters/{name}").status_code == 200
        gc.collect()
        info = server.backend.describe()
        assert info["adapter_bytes"] == 0 and info["mlx_active_bytes"] <= active0 + 4096
        r = c.post("/v1/completions", json={"model": "rslora", "prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 200  # --adapter-dir: an unknown name is loaded on demand again
        assert c.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_bad_adapters_are_refused_with_the_reason(zoo, tmp_path):
    """Adapters for another base (PEFT and mlx-lm), whole-weight fine-tunes, what mlx-lm cannot express: 422
    with the reason, the server serving on; unknown names 404, mixes and over-long requests 400."""
    wide = mlx_lm_adapter(zoo, "plain", tmp_path / "wide-mlx", wide=True)
    full = tmp_path / "full"
    shutil.copytree(wide, full)
    (full / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2}))
    roots = tmp_path / "ok"
    roots.mkdir()
    for name, src in {"wide_peft": zoo.adapter("llama", "plain", wide=True), "wide_mlx": wide, "full": full,
                      "mts": zoo.adapter("llama", "modules_to_save"), "plain": zoo.adapter("llama", "plain")}.items():
        shutil.copytree(src, roots / name)
    (roots / "empty").mkdir()
    with tuneport.serve(base=zoo.base("llama"), adapter_dir=roots, engine="mlx", port=0, n_ctx=64,
                        max_adapters=2) as server:
        c = httpx.Client(base_url=server.url, timeout=60)

        def load(name: str) -> httpx.Response:
            return c.post("/v1/adapters", json={"name": name, "path": str(roots / name)})

        for name, words in {"wide_peft": "does not fit this base", "wide_mlx": "does not fit this base",
                            "full": "'full' fine-tune", "mts": "cannot be an mlx-lm adapter",
                            "empty": "neither an mlx-lm adapter"}.items():
            r = load(name)
            assert r.status_code == 422 and words in r.json()["error"]["message"], (name, r.text)
        r = c.post("/v1/completions", json={"model": "wide_mlx", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 422  # on demand: the same refusal
        r = c.post("/v1/completions", json={"model": "unknown", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404 and "unknown" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": server.backend.name, "prompt": "x", "adapters": {"plain": 1}})
        assert r.status_code == 400 and "weighted adapter mixes" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "plain", "prompt": [1] * 60, "max_tokens": 10})
        assert r.status_code == 400 and "does not fit the context of 64" in r.json()["error"]["message"]
        assert server.backend.pool.names() == ["plain"] and ask(c, "plain", PROMPTS[0], 3)[0] == 200


def test_quantized_mlx_directory_with_bundled_and_peft_adapters(zoo, tmp_path):
    """An `export --target mlx --quant q4` directory is served as it is (quantized linears, DoRA dequantized for
    its norm); its bundled mlx-lm adapters and PEFT adapters answer as mlx-lm does over the same directory."""
    out = tmp_path / "q4"
    tuneport.export(base=zoo.base("llama"), adapters=[f"{n}={zoo.adapter('llama', n)}" for n in ("plain", "dora")],
                    target="mlx", adapter_mode="separate", quant="q4", group_size=64, out=out)
    want = {n: mlx_lm_greedy(out, out / "adapters" / n if n else None, PROMPTS[:3], 8) for n in (None, "plain", "dora")}
    with pytest.raises(tuneport.UserError, match="--dtype fp16 applies to an HF base"):
        tuneport.serve(base=out, engine="mlx", dtype="fp16", port=0)
    with tuneport.serve(base=out, adapters={"plain": out / "adapters" / "plain", "dora": out / "adapters" / "dora",
                                            "peft_dora": zoo.adapter("llama", "dora")},
                        engine="auto", port=0, n_ctx=64) as server:  # auto: an MLX directory runs on MLX
        assert server.backend.engine == "mlx" and server.backend.name == "q4"
        c = httpx.Client(base_url=server.url, timeout=60)
        jobs = [(n, i) for n in (None, "plain", "dora", "peft_dora") for i in range(3)]
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda j: ask(c, j[0] or "q4", PROMPTS[j[1]], 8), jobs))
    bad = [(j, g) for j, g in zip(jobs, got, strict=True)
           if g != (200, want["dora" if j[0] == "peft_dora" else j[0]][j[1]])]
    assert not bad, bad[:2]


def test_mlx_lm_embedding_lora_over_tied_embeddings_adapts_the_output_too(zoo, tmp_path):
    """mlx-lm applies an embedding LoRA to the tied output projection as well (``as_linear``); an mlx-lm
    adapter dir made that way answers as mlx-lm does (tuneport's PEFT converter refuses such adapters)."""
    import numpy as np
    from safetensors.numpy import save_file

    from tuneport.serve.backends.mlx import cached_mlx

    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.lora_a": rng.normal(0, 0.3, (512, 4)), "model.embed_tokens.lora_b":
               rng.normal(0, 0.3, (4, 128))}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.q_proj.lora_a"] = rng.normal(0, 0.1, (128, 4))
        tensors[f"model.layers.{i}.self_attn.q_proj.lora_b"] = rng.normal(0, 0.1, (4, 128))
    adapter = tmp_path / "tied-lora"
    adapter.mkdir()
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(adapter / "adapters.safetensors"),
              metadata={"format": "mlx"})
    (adapter / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2,
                                                            "lora_parameters": {"rank": 4, "scale": 2.0,
                                                                                "dropout": 0.0,
                                                                                "keys": ["model.embed_tokens",
                                                                                         "self_attn.q_proj"]}}))
    base = zoo.base("llama", tied=True)
    want = mlx_lm_greedy(cached_mlx(base, "auto"), adapter, PROMPTS[:3], 8)
    assert want != mlx_lm_greedy(cached_mlx(base, "auto"), None, PROMPTS[:3], 8)
    with tuneport.serve(base=base, adapters={"t": adapter}, engine="mlx", port=0, n_ctx=64) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        with ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda i: ask(c, "t", PROMPTS[i], 8), range(3)))
    assert got == [(200, w) for w in want]


def test_text_chat_stop_strings_and_sampling(zoo):
    """Completions and chat render text as the tokenizer decodes it; stop strings cut it; seeded sampling repeats."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo.base("qwen2"))
    with tuneport.serve(base=zoo.base("qwen2"), adapters={"q": zoo.adapter("qwen2", "plain")}, engine="mlx",
                        port=0, n_ctx=128) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        r = c.post("/v1/completions", json={"model": "q", "prompt": "The model", "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True}).json()
        ids = r["choices"][0]["token_ids"]
        assert r["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True)
        assert r["usage"] == {"prompt_tokens": len(r["prompt_token_ids"]), "completion_tokens": 12,
                              "total_tokens": len(r["prompt_token_ids"]) + 12}
        text = r["choices"][0]["text"]
        if len(text) > 4:
            cut = c.post("/v1/completions", json={"model": "q", "prompt": "The model", "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True, "stop": [text[2:4]]}).json()
            assert cut["choices"][0]["text"] == text[:2] and cut["choices"][0]["finish_reason"] == "stop"
        chat = c.post("/v1/chat/completions", json={"model": "q", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 6, "temperature": 0, "return_token_ids": True})
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
        assert chat.json()["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
        body = {"model": "q", "prompt": "The model", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 7,
                "ignore_eos": True, "return_token_ids": True}
        a, b = (c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] for _ in range(2))
        assert a == b and len(a) == 10


def test_cancelled_streams_leave_the_batch(zoo):
    """A client gone mid-stream: its row is dropped at the next step, its adapter released (then unloadable)."""
    import time

    with tuneport.serve(base=zoo.base("llama"), adapters={"plain": zoo.adapter("llama", "plain")}, engine="mlx",
                        port=0, n_ctx=512, pin=False) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        body = {"model": "plain", "prompt": [1, 50, 60], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        for _ in range(200):
            if server.backend.pool.states()[0]["refs"] == 0:
                break
            time.sleep(0.05)
        assert c.delete("/v1/adapters/plain").status_code == 200
        assert ask(c, server.backend.name, PROMPTS[0], 4)[0] == 200


@pytest.mark.slow  # the default run's budget (4 minutes on 2 cores): runs in the full suite (make test)
def test_cli_serves_mlx_and_plans_it(zoo, tmp_path, cli):
    code, out, err = cli("serve", "--engine", "mlx", "--base", zoo.base("llama"), "--adapter",
                         f"a={zoo.adapter('llama', 'plain')}", "--n-ctx", "256", "--concurrency", "4", "--dry-run",
                         "--json")
    assert code == 0, err
    d = json.loads(out)
    mlx = d["plans"]["mlx"]
    assert mlx["weights"] == 426_624 * 4  # fp32 conversion of the fp32 tiny llama
    assert mlx["kv_cache"] == 2 * 2 * 2 * 32 * (256 * 4) * 4  # K,V × layers × KV heads × head_dim × tokens × fp32
    assert mlx["adapters"] == 2 * (8 * 128 + 128 * 8 + 8 * 128 + 64 * 8) * 4  # q and v at r=8, 2 layers, fp32
    assert d["commands"][0]["argv"][:4] == ["tuneport", "serve", "--engine", "mlx"] and "--n-ctx" in out
    code, _, err = cli("serve", "--engine", "mlx", "--base", zoo.base("llama"), "--contexts", "3", "--dry-run")
    assert code == 2 and "--contexts: only --engine llamacpp honours it" in err

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuneport", "serve", "--engine", "mlx", "--base",
                             str(zoo.base("llama")), "--adapter", f"plain={zoo.adapter('llama', 'plain')}", "--port",
                             str(port), "--n-ctx", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ})
    try:
        assert wait_for_health(f"http://127.0.0.1:{port}", 120, interval_s=0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "plain", "prompt": "The model", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert '"POST /v1/completions" 200 model=plain' in err


def test_a_dora_adapter_leaves_other_rows_of_a_biased_linear_untouched():
    """DoRA rescales (x·Wᵀ + LoRA) and adds the bias after; rows of the base or of a plain LoRA in the same
    step must not go through that (y - bias + bias is not exact in bf16)."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from tuneport.serve.engines.mlx_lora import MultiLoraLinear, Rows

    mx.random.seed(0)
    base = nn.Linear(64, 32, bias=True)
    base.update({"weight": (mx.random.normal((32, 64)) * 3).astype(mx.bfloat16),
                 "bias": (mx.random.normal((32,)) * 50).astype(mx.bfloat16)})
    rows = Rows()
    layer = MultiLoraLinear(base, rows)
    rng = np.random.default_rng(0)
    lora = (rng.normal(size=(64, 4)).astype(np.float32), rng.normal(size=(4, 32)).astype(np.float32) * 0.1)
    layer.stack.add(1, *lora, None)
    layer.stack.add(2, *lora, mx.array(rng.uniform(0.5, 1.5, 32).astype(np.float32)))  # DoRA
    x = (mx.random.normal((3, 1, 64)) * 4).astype(mx.bfloat16)
    rows.set([0, 1, 2])
    out = layer(x)
    rows.set([0])
    alone_base = layer(x[:1])
    rows.set([1])
    alone_lora = layer(x[1:2])
    assert mx.array_equal(out[0], base(x[:1])[0]).item() and mx.array_equal(out[0], alone_base[0]).item()
    assert mx.array_equal(out[1], alone_lora[0]).item()


@pytest.mark.parametrize("quant", [None, "q4"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_expert_lora_batched_over_stacked_experts_matches_mlx_lm(zoo, tmp_path, arch, quant):
    """A mixture-of-experts base (stacked switch_mlp, quantized too; gpt-oss's biased experts) with LoRA on the
    experts, on the router and attention: base and three adapters in one batch, every answer equal to mlx-lm's own
    LoRASwitchLinear with that adapter alone."""
    names = ["experts", "plain" if arch == "gpt_oss" else "per_expert", "all_linear"]  # no per-expert gpt-oss LoRA
    out = tmp_path / "bundle"
    tuneport.export(base=zoo.base(arch), adapters=[f"{n}={zoo.adapter(arch, n)}" for n in names], target="mlx",
                    adapter_mode="separate", quant=quant, out=out)
    want = {n: mlx_lm_greedy(out, out / "adapters" / n if n else None, PROMPTS[:3], 8) for n in (None, *names)}
    assert len({json.dumps(v) for v in want.values()}) == len(want)
    with tuneport.serve(base=out, adapters={n: out / "adapters" / n for n in names}, engine="mlx", port=0,
                        n_ctx=64) as server:
        c = httpx.Client(base_url=server.url, timeout=60)
        jobs = [(n, i) for n in (None, *names) for i in range(3)] * 2
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda j: ask(c, j[0] or server.backend.name, PROMPTS[j[1]], 8), jobs))
        assert server.backend.mlx.max_batch_adapters >= 2
    bad = [(j, g) for j, g in zip(jobs, got, strict=True) if g != (200, want[j[0]][j[1]])]
    assert not bad, bad[:2]


def test_chunked_attention_is_refused_at_start_with_what_serves_it(zoo, tmp_path):
    """Llama 4's RoPE layers attend in chunks, for which mlx-lm keeps a ChunkedKVCache it cannot batch: tuneport serve
    --engine mlx refuses at start in one line (mlx_lm.server or another engine serves it; its export is proven in
    tests/test_mlx_export.py, llama.cpp serves it mixed in tests/test_serve_llamacpp.py)."""
    from tuneport.convert.errors import UserError

    out = tmp_path / "mlx"
    tuneport.export(base=zoo.base("llama4_text"), target="mlx", out=out)
    with pytest.raises(UserError, match=r"cannot batch this model's caches \(ChunkedKVCache\)") as e:
        with tuneport.serve(base=out, engine="mlx", port=0, n_ctx=64):
            pass
    assert "another engine" in e.value.hint


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2", "gemma4_text", "granitemoehybrid"])
def test_hybrid_linear_attention_mixed_adapters_match_mlx_lm_alone(zoo, tmp_path, arch):
    """Qwen3.5 (Gated DeltaNet layers: a convolution and a recurrent state per sequence), LFM2 (short
    convolutions), Granite 4 (Mamba-2: a convolution and a scan state per sequence) and Gemma 4 (per-layer
    embeddings, layers reading earlier layers' KV): the base and adapters on the attention and on every linear,
    prompts of different lengths at concurrency 6 through the gateway; every answer equals mlx-lm's with only that
    adapter."""
    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.convert.mlx.adapters import mlx_adapter, write_mlx_adapter
    from tuneport.serve.backends.mlx import cached_mlx

    base = zoo.base(arch)
    names = [None, "plain", "all_linear"]
    mlx_dir = cached_mlx(base, "auto")
    want = {}
    for name in names:
        adapter = None
        if name:
            adapter = tmp_path / name
            write_mlx_adapter(mlx_adapter(load_adapter(zoo.adapter(arch, name)), Checkpoint(base)), adapter)
        for i, toks in enumerate(mlx_lm_greedy(mlx_dir, adapter, PROMPTS, N)):
            want[(name, i)] = toks
    assert len({tuple(want[(n, 0)]) for n in names}) == len(names)  # each adapter changes the answer
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names] * 2
    with tuneport.serve(base=base, adapters={n: str(zoo.adapter(arch, n)) for n in names[1:]},
                        engine="mlx", port=0, n_ctx=64) as server:
        c = httpx.Client(base_url=server.url, timeout=120)
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda j: ask(c, j[0] or server.backend.name, PROMPTS[j[1]]), jobs))
    bad = [(j, g) for j, g in zip(jobs, got, strict=True) if g != (200, want[j])]
    assert not bad, bad[:2]
