"""Per-sequence LoRA in llama.cpp's graph (toolkit/llama_cpp_patches/0001): in ONE decode batch mixing the base, five
adapters of different ranks and targets (plain r=8 on q/v, rsLoRA r=16, rank/alpha patterns, all linears, token
embeddings + q_proj) and two weighted two-adapter sets, every sequence's logits equal the same sequence decoded
alone in a fresh context with its adapters set the stock way (llama_set_adapters_lora), at every step of a 32-token
greedy run (F32 GGUF, F32 KV cache), and transformers + PEFT in fp32 (single-adapter sets); also across an
unbind/rebind in the middle of the run. Skipped with a stock
llama-cpp-python (the engine's fallback is tested in test_serve_llamacpp.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_serve_llamacpp import export_separate

pytestmark = pytest.mark.llamacpp
TOL = 1e-4
STEPS = 32
ADAPTERS = ["plain", "rslora", "patterns", "all_linear", "embedding"]
SETS = [[], [("plain", 1.0)], [("rslora", 1.0)], [("patterns", 1.0)], [("all_linear", 1.0)], [("embedding", 1.0)],
        [("plain", 1.0), ("rslora", 0.5)], [("embedding", 0.7), ("all_linear", 1.0)]]
PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 3], [1, 200, 300, 411, 7, 8], [1, 9, 10], [1, 33, 44, 55, 66, 77, 88],
           [1, 123, 45], [1, 5, 6, 7], [1, 250, 251]]


@pytest.fixture(scope="module")
def lib(zoo, tmp_path_factory):
    import llama_cpp as lc

    from tuneport.serve.engines.llamacpp_seq_lora import seq_lora

    seq = seq_lora(lc)
    if seq is None:
        pytest.skip("a stock llama-cpp-python (no per-sequence LoRA): `make setup` builds tuneport's")
    out = tmp_path_factory.mktemp("seq-lora") / "gguf"
    export_separate(zoo.base("llama"), {v: zoo.adapter("llama", v) for v in ADAPTERS}, out)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(next(out.glob("*-F32.gguf"))).encode(), lc.llama_model_default_params())
    adapters = {n: lc.llama_adapter_lora_init(model, str(out / "adapters" / f"{n}-F32.gguf").encode())
                for n in ADAPTERS}
    assert model and all(adapters.values())
    yield lc, seq, model, adapters
    for a in adapters.values():
        lc.llama_adapter_lora_free(a)
    lc.llama_model_free(model)


def new_context(lc, model, n_seq: int):
    cp = lc.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.type_k = cp.type_v = lc.GGML_TYPE_F32
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return lc.llama_init_from_model(model, cp)


def decode(lc, ctx, model, prompts: dict[int, list[int]], steps: int, between=None) -> dict[int, list[np.ndarray]]:
    """Prefill every sequence's prompt in one batch, then ``steps`` greedy tokens with all sequences in each batch;
    each sequence's logits at every step. ``between(step)`` runs before each decode."""
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, max(prompts) + 1)
    pos = dict.fromkeys(prompts, 0)
    feed = {s: list(p) for s, p in prompts.items()}
    out: dict[int, list[np.ndarray]] = {s: [] for s in prompts}
    try:
        for step in range(steps + 1):
            if between:
                between(step)
            batch.n_tokens, rows = 0, {}
            for s, toks in feed.items():
                for j, t in enumerate(toks):
                    i = batch.n_tokens
                    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos[s], 1, s
                    batch.logits[i] = j == len(toks) - 1
                    rows[s] = i
                    batch.n_tokens += 1
                    pos[s] += 1
            assert lc.llama_decode(ctx, batch) == 0
            for s, i in rows.items():
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                out[s].append(logits)
                feed[s] = [int(logits.argmax())]
    finally:
        lc.llama_batch_free(batch)
    return out


def alone(lc, model, adapters, adapter_set, prompt) -> list[np.ndarray]:
    """The sequence decoded alone in a fresh context, its adapters attached to the context (stock llama.cpp)."""
    ctx = new_context(lc, model, 1)
    try:
        if adapter_set:
            ptrs = (lc.llama_adapter_lora_p_ctypes * len(adapter_set))(*(adapters[n] for n, _ in adapter_set))
            scales = (ctypes.c_float * len(adapter_set))(*(w for _, w in adapter_set))
            lc.llama_set_adapters_lora(ctx, ptrs, len(adapter_set), scales)
        return decode(lc, ctx, model, {0: prompt}, STEPS)[0]
    finally:
        lc.llama_free(ctx)


def bind(seq, ctx, adapters, s: int, adapter_set) -> None:
    seq.bind(ctx, s, [adapters[n] for n, _ in adapter_set], [w for _, w in adapter_set])


def worst(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))


def test_one_batch_of_every_adapter_set_equals_each_sequence_decoded_alone(lib, zoo, capsys):
    lc, seq, model, adapters = lib
    want = {s: alone(lc, model, adapters, st, p) for s, (st, p) in enumerate(zip(SETS, PROMPTS, strict=True))}
    ctx = new_context(lc, model, len(SETS))
    try:
        for s, st in enumerate(SETS):
            bind(seq, ctx, adapters, s, st)
        got = decode(lc, ctx, model, dict(enumerate(PROMPTS)), STEPS)
    finally:
        lc.llama_free(ctx)
    rows = [(SETS[s], worst(got[s], want[s]), worst(want[s], want[0]) if s else 0.0) for s in want]
    with capsys.disabled():
        print("\nper-sequence LoRA, one batch vs each sequence alone (max|d| over 33 steps; the adapter's effect):")
        for st, d, effect in rows:
            print(f"  {st or 'base'}: {d:.1e} (effect {effect:.2f})")
    assert all(d <= TOL for _, d, _ in rows), rows
    assert all(effect > 0.1 for st, _, effect in rows if st)
    # and transformers + PEFT (fp32) on the same tokens, at every step (single-adapter sets and the base)
    import torch

    from tuneport.toolkit.fidelity import load_hf, load_peft, logits

    for s, st in enumerate(SETS):
        if len(st) > 1:
            continue
        ref = load_peft(zoo.base("llama"), zoo.adapter("llama", st[0][0])) if st else load_hf(zoo.base("llama"))
        ids = PROMPTS[s] + [int(x.argmax()) for x in got[s][:-1]]
        want_hf = logits(ref, torch.tensor([ids]))[0, len(PROMPTS[s]) - 1:].numpy()
        assert max(float(np.abs(want_hf[k] - got[s][k]).max()) for k in range(STEPS + 1)) <= TOL, st


def test_unbinding_and_rebinding_mid_run_stays_exact(lib):
    """Sequence 1 loses its adapter for steps 8-15 and gets it back (a new set rebuilds the stacks each time):
    before, after and in between, its logits are those of the stock decode of the same schedule."""
    lc, seq, model, adapters = lib
    prompts = {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[2]}
    plan = {0: [], 1: [("plain", 1.0)], 2: [("all_linear", 1.0)]}

    def schedule(ctx, per_sequence: bool):
        def between(step: int) -> None:
            st = [] if 8 <= step < 16 else plan[1]
            if per_sequence:
                bind(seq, ctx, adapters, 1, st)
            elif step in (0, 8, 16):
                ptrs = (lc.llama_adapter_lora_p_ctypes * max(1, len(st)))(*(adapters[n] for n, _ in st))
                lc.llama_set_adapters_lora(ctx, ptrs if st else None, len(st),
                                           (ctypes.c_float * max(1, len(st)))(*(w for _, w in st)) if st else None)
        return between

    ctx = new_context(lc, model, 3)
    try:
        for s in (0, 2):
            bind(seq, ctx, adapters, s, plan[s])
        got = decode(lc, ctx, model, prompts, 24, schedule(ctx, True))
    finally:
        lc.llama_free(ctx)
    ctx = new_context(lc, model, 1)
    try:
        want = decode(lc, ctx, model, {0: prompts[1]}, 24, schedule(ctx, False))[0]
    finally:
        lc.llama_free(ctx)
    assert worst(got[1], want) <= TOL
