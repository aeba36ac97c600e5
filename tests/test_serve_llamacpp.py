"""serve.engines.llamacpp: mixed adapters over one model, each answer equal to a fresh llama.cpp
instance holding only that adapter (and to PEFT for the first tokens, F32 GGUF + F32 KV cache)."""

from __future__ import annotations

import shutil
import threading

import pytest
from tests_helpers import fresh_greedy, run_threads

from convert.errors import UserError
from convert.export_hf import AdapterArg
from convert.gguf.export import export_gguf
from serve.engines.base import GenerationRequest
from serve.engines.llamacpp import LlamaCppEngine
from toolkit.fidelity import greedy, load_peft

pytestmark = pytest.mark.llamacpp
ADAPTERS = ["plain", "all_linear", "rslora"]
PROMPTS = [[1, 50, 60, 70], [1, 200, 300, 411, 7], [1, 9, 8, 7, 6, 5], [1, 100]]
N = 8


@pytest.fixture(scope="module")
def bundle(zoo, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "gguf"
    export_gguf(zoo.base("llama"), [AdapterArg(zoo.adapter("llama", v), name=v) for v in ADAPTERS], out,
                mode="separate", quant="f32")
    return out


def test_mixed_concurrent_requests_match_fresh_instances_and_peft(zoo, bundle):
    model = bundle / "llama-fp32-F32.gguf"
    engine = LlamaCppEngine(model, n_ctx=64, n_workers=2, kv_f32=True)
    try:
        for v in ADAPTERS:
            engine.load_adapter(v, bundle / "adapters" / f"{v}-F32.gguf")
        choices = [None, *ADAPTERS]
        want = {(c, i): fresh_greedy(model, bundle / "adapters" / f"{c}-F32.gguf" if c else None, p, N)
                for c in choices for i, p in enumerate(PROMPTS)}
        for v in ADAPTERS:  # F32 GGUF + F32 KV: llama.cpp's greedy tokens are PEFT's
            peft_model = load_peft(zoo.base("llama"), zoo.adapter("llama", v))
            for i, p in enumerate(PROMPTS):
                assert want[(v, i)] == greedy(peft_model, p, N), (v, i)
        jobs = [(choices[k % 4], k % len(PROMPTS)) for k in range(48)]
        got: dict[int, list[int]] = {}
        errors = []

        def run(worker: int) -> None:
            for k in range(worker, len(jobs), 4):
                c, i = jobs[k]
                try:
                    req = GenerationRequest(PROMPTS[i], {c: 1.0} if c else {}, max_tokens=N, ignore_eos=True)
                    got[k] = list(engine.generate(req))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        run_threads(run, [(w,) for w in range(4)])
        assert not errors, errors[:1]
        wrong = [k for k, (c, i) in enumerate(jobs) if got[k] != want[(c, i)]]
        assert not wrong, [(jobs[k], got[k], want[jobs[k]]) for k in wrong[:2]]

        # requests that share an adapter set are decoded together (continuous batching)
        same = [threading.Thread(target=lambda i=i: got.__setitem__(1000 + i, list(engine.generate(
            GenerationRequest(PROMPTS[i % 4], {"plain": 1.0}, max_tokens=N, ignore_eos=True))))) for i in range(8)]
        for t in same:
            t.start()
        for t in same:
            t.join()
        assert engine.max_batch_seqs >= 2
        assert all(got[1000 + i] == want[("plain", i % 4)] for i in range(8))
        engine.unload_adapter("plain")
        with pytest.raises(UserError, match="not loaded"):
            list(engine.generate(GenerationRequest(PROMPTS[0], {"plain": 1.0}, max_tokens=2)))
    finally:
        engine.close()


def test_bad_adapters_are_refused_before_llamacpp(zoo, bundle, tmp_path):
    engine = LlamaCppEngine(bundle / "llama-fp32-F32.gguf", n_ctx=64, n_workers=1)
    try:
        other = tmp_path / "qwen"
        export_gguf(zoo.base("qwen2"), [AdapterArg(zoo.adapter("qwen2", "plain"), name="q")], other,
                    mode="separate", quant="f32")
        with pytest.raises(UserError, match="architecture"):
            engine.load_adapter("q", other / "adapters" / "q-F32.gguf")
        wide = tmp_path / "wide"
        export_gguf(zoo.base("llama", wide=True), [AdapterArg(zoo.adapter("llama", "plain", wide=True), name="w")],
                    wide, mode="separate", quant="f32")
        with pytest.raises(UserError, match="do not fit"):
            engine.load_adapter("w", wide / "adapters" / "w-F32.gguf")
        corrupt = tmp_path / "corrupt.gguf"
        shutil.copy(bundle / "adapters" / "plain-F32.gguf", corrupt)
        corrupt.write_bytes(corrupt.read_bytes()[:100])
        with pytest.raises(UserError):
            engine.load_adapter("c", corrupt)
        engine.load_adapter("plain", bundle / "adapters" / "plain-F32.gguf")  # the engine still works
        assert len(list(engine.generate(GenerationRequest(PROMPTS[0], {"plain": 1.0}, max_tokens=3,
                                                          ignore_eos=True)))) == 3
    finally:
        engine.close()
