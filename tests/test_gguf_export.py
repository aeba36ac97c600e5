"""--target gguf in real llama.cpp (llama-cpp-python, F32 KV cache, flash attention off)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_merge_equivalence import moe_cases

from tuneport.convert.arch import known_arch
from tuneport.convert.gguf.quant_types import QUANT_TYPES
from tuneport.convert.support_matrix import supported
from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, load_peft, logits

pytestmark = pytest.mark.llamacpp
IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]
LORA_VARIANTS = ["plain", "all_linear", "rslora", "patterns", "embedding", "regex", "layers"]


def export(cli, *args):
    code, out, err = cli("export", "--target", "gguf", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def gguf_vs(ref: torch.Tensor, path, lora=None) -> tuple:
    llm = llamacpp_model(path, lora)
    try:
        got = llamacpp_logits(llm, IDS)
    finally:
        llm.close()
    return compare_logits(ref, got)


# llama.cpp evaluates GELU through an fp16 lookup table on the CPU (HF: exact tanh-GELU), which alone
# moves Gemma's logits by ~2.6e-3 here; emulating that table in HF brings the difference to ~2.5e-4.
TOL = {"f32": 1e-4, "f32_kl": 1e-8, "f16": 1e-2, "q8_kl": 1e-2}
GEMMA_TOL = {"f32": 5e-3, "f32_kl": 1e-6, "f16": 5e-2}
# Gemma 4: more GELUs per layer (the per-layer-input gate too), each through ggml's fp16 table on CPU: 7.8e-3 on the
# tiny model (1.5e-2 with an all-linear LoRA), 1.1e-3 (1.4e-3) with that table's rounding emulated in transformers
GEMMA4_TOL = {"f32": 3e-2, "f32_kl": 2e-6, "f16": 5e-2, "q8_kl": 2e-2}
# Qwen3.5's recurrent layers carry the rounding of in_proj_a / in_proj_b (the decay and write strength) across
# every later position (F32: 2.9e-5 apart): measured 3.9e-2 at F16 (KL 1.9e-5) and KL 2.47e-2 at Q8_0, which is what
# llama.cpp's own quantizer gives from the F32 file too (the same KL to the digit)
DELTA_NET_TOL = {"f16": 5e-2, "q8_kl": 5e-2}
# and with experts, a rounding that flips a token's second expert moves its logits further: F16 0.20, Q8_0 KL 0.14
# (llama.cpp's quantizer from the F32 file: the same KL to the digit); F32 stays 5e-5 apart, a LoRA with per-module
# ranks 1.5e-4
DELTA_NET_MOE_TOL = {"f32": 2e-4, "f16": 0.25, "q8_kl": 0.2}
# where the tolerance is that loose, the Q8_0 file must give what llama.cpp's own quantizer makes of the F32 one
SAME_AS_LLAMACPP_Q8 = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "gemma4_text", "gemma4")
ARCH_TOL = {"gemma4_text": GEMMA4_TOL, "gemma4": GEMMA4_TOL,
            "gemma3_text": GEMMA_TOL, "gemma3": GEMMA_TOL, "gemma2": GEMMA_TOL, "qwen3_5_text": DELTA_NET_TOL,
            "qwen3_5": DELTA_NET_TOL, "qwen3_5_moe_text": DELTA_NET_MOE_TOL, "qwen3_5_moe": DELTA_NET_MOE_TOL}


@pytest.mark.parametrize("arch", supported("gguf"))
def test_model_parity_f32_f16_q8(zoo, tmp_path, cli, arch):
    import hashlib

    base = zoo.base(arch)
    out = tmp_path / "gguf"
    m = export(cli, "--base", base, "--quant", "f32,f16,q8_0", "--out", out)
    for o in m["outputs"]:  # hashed while written
        assert o["sha256"] == hashlib.sha256((out / o["path"]).read_bytes()).hexdigest(), o["path"]
    ref = logits(load_hf(base), torch.tensor([IDS]))[0]
    f32 = gguf_vs(ref, out / f"{base.name}-F32.gguf")
    f16 = gguf_vs(ref, out / f"{base.name}-F16.gguf")
    q8 = gguf_vs(ref, out / f"{base.name}-Q8_0.gguf")
    print(f"\n{arch}: F32 max|d| {f32.max_abs:.2e}; F16 max|d| {f16.max_abs:.2e}; "
          f"Q8_0 KL {q8.kl:.2e} top1 {q8.top1:.2f}")
    tol = {**TOL, **ARCH_TOL.get(arch, {})}
    assert f32.max_abs <= tol["f32"]
    assert f32.kl <= tol["f32_kl"]
    assert f16.max_abs <= tol["f16"]
    assert q8.kl <= tol["q8_kl"]
    if arch in SAME_AS_LLAMACPP_Q8:
        from tuneport.convert.gguf.quant_types import QUANT_TYPES
        from tuneport.convert.gguf.quantize import quantize_with_llamacpp

        quantize_with_llamacpp(out / f"{base.name}-F32.gguf", tmp_path / "llamacpp-q8.gguf", QUANT_TYPES["q8_0"])
        theirs = gguf_vs(ref, tmp_path / "llamacpp-q8.gguf")
        assert (theirs.max_abs, theirs.kl) == (q8.max_abs, q8.kl), (theirs, q8)


@pytest.mark.parametrize("arch", supported("gguf"))
def test_every_architecture_lora_matches_peft(zoo, tmp_path, cli, arch):
    """Every architecture of the table: an adapter on all linears as a GGUF LoRA over the F32 base = PEFT."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, "all_linear")
    export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}",
           "--out", tmp_path / "gguf")
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    cmp = gguf_vs(ref, tmp_path / "gguf" / f"{base.name}-F32.gguf", tmp_path / "gguf" / "adapters" / "a-F32.gguf")
    print(f"\n{arch}: LoRA max|d| {cmp.max_abs:.2e}")
    assert cmp.max_abs <= {**TOL, **ARCH_TOL.get(arch, {})}["f32"], cmp


def test_granite4_without_mamba_layers_runs_as_a_granite_3_model(tmp_path, cli):
    """Granite-4.0-Micro's shape (granitemoehybrid, every layer attention, RoPE): written as llama.cpp's granite graph,
    as its converter writes it (its granitehybrid graph aborts loading a model without a recurrent layer), the shared
    MLP as the MLP; the base and an adapter on all linears as a GGUF LoRA = transformers and PEFT."""
    import gguf

    from tuneport.toolkit.tiny import make_base
    from tuneport.toolkit.tiny.adapters import make_adapter

    base = make_base("granitemoehybrid", tmp_path / "micro",
                     dims={"layer_types": ["attention"] * 4, "position_embedding_type": "rope"})
    adapter = make_adapter(base, "all_linear", tmp_path / "adapter")
    export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}",
           "--out", tmp_path / "gguf")
    model, lora = tmp_path / "gguf" / "micro-F32.gguf", tmp_path / "gguf" / "adapters" / "a-F32.gguf"
    for path in (model, lora):
        assert gguf.GGUFReader(str(path)).get_field("general.architecture").contents() == "granite"
    base_cmp = gguf_vs(logits(load_hf(base), torch.tensor([IDS]))[0], model)
    lora_cmp = gguf_vs(logits(load_peft(base, adapter), torch.tensor([IDS]))[0], model, lora)
    print(f"\nGranite-4.0-Micro's shape: base max|d| {base_cmp.max_abs:.2e}, LoRA {lora_cmp.max_abs:.2e}")
    assert base_cmp.max_abs <= TOL["f32"] and lora_cmp.max_abs <= TOL["f32"], (base_cmp, lora_cmp)


# Llama 4 as released exports its text model (llama4_text) renamed: its parity and LoRA tests cover the renaming, the
# expert LoRA runs on llama4_text (CI time)
MOE = [a for a in supported("gguf") if (spec := known_arch(a)) is not None and spec.experts is not None
       and a != "llama4"]


@pytest.mark.parametrize("arch,variant", moe_cases(MOE))
def test_expert_lora_matches_peft_and_merge(zoo, tmp_path, cli, arch, variant):
    """LoRA on the experts (fused target_parameters, or transformers 4's per-expert modules) as a GGUF LoRA on
    llama.cpp's stacked expert tensors (applied through mul_mat_id), and merged: both = PEFT."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, variant)
    sep, merged = tmp_path / "sep", tmp_path / "merged"
    export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}", "--out", sep)
    export(cli, "--base", base, "--quant", "f32", "--adapters", "merge", "--adapter", adapter, "--out", merged)
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    lora = gguf_vs(ref, sep / f"{base.name}-F32.gguf", sep / "adapters" / "a-F32.gguf")
    merged_cmp = gguf_vs(ref, merged / f"{base.name}-F32.gguf")
    print(f"\n{arch} {variant}: LoRA max|d| {lora.max_abs:.2e}, merged {merged_cmp.max_abs:.2e}")
    assert lora.max_abs <= 1e-4, lora
    assert merged_cmp.max_abs <= 1e-4, merged_cmp
    assert (ref - logits(load_hf(base), torch.tensor([IDS]))[0]).abs().max().item() > 0.1


def test_mixtral_tensors_equal_llama_cpps_converter(zoo, tmp_path, upstream):
    """Every tensor of a tiny Mixtral (experts stacked per layer and projection, the router kept F32) has the
    name, shape, type and bytes llama.cpp's own convert_hf_to_gguf.py writes; so do the expert hyperparameters."""
    import gguf
    import numpy as np

    import tuneport

    base = zoo.base("mixtral")
    theirs = tmp_path / "upstream-F32.gguf"
    upstream("convert_hf_to_gguf.py", base, "--outfile", theirs, "--outtype", "f32")
    tuneport.export(base=base, target="gguf", quant="f32", out=tmp_path / "ours")
    up, ours = gguf.GGUFReader(theirs), gguf.GGUFReader(tmp_path / "ours" / f"{base.name}-F32.gguf")
    theirs_t, ours_t = {t.name: t for t in up.tensors}, {t.name: t for t in ours.tensors}
    assert sorted(theirs_t) == sorted(ours_t)
    assert any(n.endswith("ffn_gate_exps.weight") for n in ours_t)
    for name, t in theirs_t.items():
        o = ours_t[name]
        assert (o.shape.tolist(), o.tensor_type) == (t.shape.tolist(), t.tensor_type), name
        assert np.array_equal(np.asarray(o.data), np.asarray(t.data)), name
    for key in ("llama.expert_count", "llama.expert_used_count", "llama.feed_forward_length", "llama.block_count"):
        assert ours.get_field(key).contents() == up.get_field(key).contents(), key


def _lora_cases() -> list:
    from test_merge_equivalence import UNBUILDABLE

    from tuneport.toolkit.tiny import TINY_ARCHS

    refused = {(a, "embedding"): f"embedding LoRA over tied embeddings ({a} is always tied)"
               for a in ("gemma2", "lfm2")}
    cases = []
    for a in supported("gguf"):
        for v in LORA_VARIANTS:
            why = UNBUILDABLE.get((a, v)) or refused.get((a, v))
            if a in TINY_ARCHS and not TINY_ARCHS[a].text_config_class:
                cases.append(pytest.param(a, v, marks=pytest.mark.skip(reason=why)) if why else (a, v))
    return cases


@pytest.mark.parametrize(("arch", "variant"), _lora_cases())
def test_lora_separate_matches_peft_and_merge(zoo, tmp_path, cli, arch, variant):
    """Every LoRA variant on every architecture of the table, as a GGUF LoRA and merged, in llama.cpp = PEFT."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, variant)
    sep, merged = tmp_path / "sep", tmp_path / "merged"
    m = export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}",
               "--out", sep)
    export(cli, "--base", base, "--quant", "f32", "--adapters", "merge", "--adapter", adapter, "--out", merged)
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    assert m["loras"] == {"a": "adapters/a-F32.gguf"}
    lora = gguf_vs(ref, sep / f"{base.name}-F32.gguf", sep / "adapters" / "a-F32.gguf")
    merged_cmp = gguf_vs(ref, merged / f"{base.name}-F32.gguf")
    tol = {**TOL, **ARCH_TOL.get(arch, {})}["f32"]
    assert lora.max_abs <= tol, lora
    assert merged_cmp.max_abs <= tol, merged_cmp
    modelfile = (sep / "Modelfile.a").read_text()
    assert "ADAPTER ./adapters/a-F32.gguf" in modelfile


def test_tied_base_and_lora(zoo, tmp_path, cli):
    """Tied embeddings: llama.cpp reuses token_embd as the output; a LoRA over the tied base works."""
    base, adapter = zoo.base("llama", tied=True), zoo.adapter("llama", "tied")
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}", "--out", out)
    assert gguf_vs(logits(load_hf(base), torch.tensor([IDS]))[0], out / f"{base.name}-F32.gguf").max_abs <= 1e-4
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    assert gguf_vs(ref, out / f"{base.name}-F32.gguf", out / "adapters" / "a-F32.gguf").max_abs <= 1e-4


def test_phi3_fused_module_lora(zoo, tmp_path, cli):
    """LoRA on phi3's fused qkv_proj / gate_up_proj maps to attn_qkv / ffn_up unchanged."""
    from peft import LoraConfig, get_peft_model

    base = zoo.base("phi3")
    adapter = tmp_path / "phi3-lora"
    model = load_hf(base)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(adapter)
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f32", "--adapters", "separate", "--adapter", f"a={adapter}", "--out", out)
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    cmp = gguf_vs(ref, out / f"{base.name}-F32.gguf", out / "adapters" / "a-F32.gguf")
    assert cmp.max_abs <= 1e-4, cmp


@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_lora_over_quantized_base(zoo, tmp_path, cli, quant):
    base, adapter = zoo.base("llama", wide=True), zoo.adapter("llama", "all_linear", wide=True)
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", quant, "--adapters", "separate", "--adapter", f"a={adapter}", "--out", out)
    ref = logits(load_peft(base, adapter), torch.tensor([IDS]))[0]
    label = QUANT_TYPES[quant].label
    cmp = gguf_vs(ref, out / f"{base.name}-{label}.gguf", out / "adapters" / "a-F32.gguf")
    without = gguf_vs(ref, out / f"{base.name}-{label}.gguf")
    print(f"\nLoRA over {label}: KL(PEFT || llama.cpp) = {cmp.kl:.3e}, top-1 {cmp.top1:.2f} "
          f"(without the LoRA: KL {without.kl:.3e})")
    assert cmp.kl < without.kl / 5  # the adapter is applied
    assert cmp.kl <= (1e-2 if quant == "q8_0" else 0.5)


def test_every_quant_type_loads_with_its_type(zoo, tmp_path, cli):
    import llama_cpp

    base = zoo.base("llama", wide=True)
    out = tmp_path / "gguf"
    plain = {n: q for n, q in QUANT_TYPES.items() if not q.needs_imatrix}  # the others: tests/test_imatrix.py
    m = export(cli, "--base", base, "--quant", ",".join(plain), "--out", out)
    assert set(m["models"]) == set(plain)
    from gguf import GGUFReader

    for q in plain.values():
        path = out / f"{base.name}-{q.label}.gguf"
        llm = llamacpp_model(path)
        try:
            assert int(llm.metadata["general.file_type"]) == q.ftype, q.name
            assert llama_cpp.llama_model_ftype(llm.model) == q.ftype, q.name
            llm.eval(IDS[:4])
        finally:
            llm.close()
        if q.k_quant:  # hidden 256: no fallback types in the weights
            types = {t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
            assert not types & {"Q4_0", "Q5_0", "Q5_1", "F16"} or q.name == "q2_k", (q.name, types)


BPE_STRINGS = [
    "Hello world", "hello  world", "   leading spaces", "trailing spaces   ", "tabs\tand\ttabs",
    "new\nlines\n\n\nmany", "emoji 🙂🚀 and ✨", "日本語のテキスト", "Привет, мир!", "Grüße aus München",
    "def add(a, b):\n    return a + b", "x = [1, 2, 3]  # comment", "12345 678 9", "it's they're we've",
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>assistant\n", "text<|endoftext|>more", "a<|im_end|>b",
    "   ", "\n", "mixed 123abc ABC", "url https://example.com/a?b=c", "math: α+β=γ",
]
SP_STRINGS = [
    "Hello world", "hello world again", "The model merges the adapter.", "tabs\tand\ttabs", "new\nlines",
    "emoji 🙂🚀 and ✨", "日本語のテキスト", "Привет, мир!", "Grüße aus München", "def add(a, b):",
    "x = [1, 2, 3]", "12345 678 9", "it's they're", "mixed 123abc ABC", "url https://example.com/a?b=c",
    "math: α+β=γ", "end of turn</s>", "user says hi [/INST]", "question?[/INST]", "a b c d e f", "trailing  ",
]


@pytest.mark.parametrize("arch,strings", [("qwen2", BPE_STRINGS), ("llama", SP_STRINGS)])
def test_tokenization_matches_hf(zoo, tmp_path, cli, arch, strings):
    from transformers import AutoTokenizer

    base = zoo.base(arch)
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f16", "--out", out)
    tok = AutoTokenizer.from_pretrained(base)
    llm = llamacpp_model(out / f"{base.name}-F16.gguf")
    try:
        add_bos = tok("a").input_ids[0] == tok.bos_token_id if tok.bos_token_id is not None else False
        mismatches = []
        for s in strings:
            hf = tok(s).input_ids
            lc = llm.tokenize(s.encode(), add_bos=add_bos, special=True)
            if hf != lc:
                mismatches.append((s, hf, lc))
            # detokenize round-trips: llama.cpp's text equals HF's decode and the original string
            text = llm.detokenize(hf, special=False).decode()
            assert text == tok.decode(hf, skip_special_tokens=True), s
            if not any(t in s for t in ("<|", "</s>", "[/INST]")):
                assert text == s, s
        assert len(strings) >= 20 and not mismatches, mismatches[:3]
    finally:
        llm.close()


def test_sentencepiece_space_runs_follow_sentencepiece(zoo, tmp_path, cli):
    """Known divergence: HF's fast tokenizer splits a leading run of spaces differently from the
    SentencePiece model it was converted from; llama.cpp follows SentencePiece."""
    import sentencepiece as spm

    base = zoo.base("llama")
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f32", "--out", out)
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    llm = llamacpp_model(out / f"{base.name}-F32.gguf")
    try:
        for s in ["  two  spaces\n\nnewlines", "Hello world", "  x"]:
            assert llm.tokenize(s.encode(), add_bos=False, special=False) == sp.encode(s), s
    finally:
        llm.close()


def test_chat_template_renders_same_tokens_as_hf(zoo, tmp_path, cli):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    from transformers import AutoTokenizer

    base = zoo.base("qwen2")
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f32", "--out", out)
    llm = llamacpp_model(out / f"{base.name}-F32.gguf")
    try:
        template = llm.metadata["tokenizer.chat_template"]
        tok = AutoTokenizer.from_pretrained(base)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 🙂"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Merge my adapter."}]
        fmt = Jinja2ChatFormatter(template, eos_token=tok.eos_token or "", bos_token=tok.bos_token or "")
        res = fmt(messages=messages)
        ours = llm.tokenize(res.prompt.encode(), add_bos=not res.added_special, special=True)
        hf = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        hf = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
        assert ours == list(hf)
    finally:
        llm.close()
    modelfile = (out / "Modelfile").read_text()
    assert "<|im_start|>assistant" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_inspect_reads_gguf(zoo, tmp_path, cli):
    out = tmp_path / "gguf"
    export(cli, "--base", zoo.base("llama"), "--quant", "q8_0", "--adapters", "separate",
           "--adapter", f"a={zoo.adapter('llama', 'plain')}", "--out", out)
    code, text, _ = cli("inspect", out / "llama-fp32-Q8_0.gguf", "--json")
    r = json.loads(text)
    assert r["kind"] == "gguf-model" and "Q8_0" in r["quant_types"] and r["chat_template"] is True
    code, text, _ = cli("inspect", out / "adapters" / "a-F32.gguf", "--json")
    r = json.loads(text)
    assert r["kind"] == "gguf-lora" and r["architecture"] == "llama" and r["lora_alpha"] == 16.0


def refused(cli, out, *args, expect: str) -> str:
    code, _, err = cli("export", "--target", "gguf", "--out", out, *args)
    assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    return err


def test_bad_input(zoo, tmp_path, cli):
    base = tmp_path / "base"
    # SmolLM3's tokenizer runs the file's pre-tokenizer (transformers 5 rebuilds Qwen2's own, by model type)
    shutil.copytree(zoo.base("smollm3"), base)
    tj = json.loads((base / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    (base / "tokenizer.json").write_text(json.dumps(tj))
    err = refused(cli, tmp_path / "o1", "--base", base, "--quant", "f16", expect="--bpe-pre")
    assert "pre-tokenizer" in err
    # forcing a pre-tokenizer that is not this one: the written file is checked, and refused (names the strings)
    err = refused(cli, tmp_path / "o1b", "--base", base, "--quant", "f16", "--bpe-pre", "qwen2",
                  expect="llama.cpp would tokenize differently from the tokenizer in")
    assert "--accept-tokenizer-difference" in err
    code, _, err = cli("export", "--target", "gguf", "--out", tmp_path / "o1b", "--base", base, "--quant", "f16",
                       "--bpe-pre", "qwen2", "--accept-tokenizer-difference")
    assert code == 0, err

    mamba = tmp_path / "mamba"
    shutil.copytree(zoo.base("llama"), mamba)
    cfg = json.loads((mamba / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (mamba / "config.json").write_text(json.dumps(cfg))
    err = refused(cli, tmp_path / "o2", "--base", mamba, expect="unsupported architecture")
    assert "llama" in err and "qwen2" in err

    refused(cli, tmp_path / "o3", "--base", zoo.base("llama"), "--adapters", "separate",
            "--adapter", zoo.adapter("llama", "dora"), expect="DoRA")
    refused(cli, tmp_path / "o3b", "--base", zoo.base("llama"), "--adapters", "separate",
            "--adapter", zoo.adapter("llama", "modules_to_save"), expect="modules_to_save")
    from tuneport.toolkit.tiny import make_adapter, make_base

    small = make_base("llama", tmp_path / "small", dims=dict(hidden_size=64, intermediate_size=128,
                                                             num_attention_heads=2, num_key_value_heads=1))
    other = make_adapter(small, "plain", tmp_path / "small-adapter")
    refused(cli, tmp_path / "o4", "--base", zoo.base("llama"), "--adapters", "separate", "--adapter", other,
            expect="does not fit this base")
    refused(cli, tmp_path / "o5", "--base", zoo.base("llama"), "--quant", "q9_9", expect="unknown --quant")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merge_with_resized_vocab_and_added_tokens(zoo, tmp_path, cli, arch):
    """modules_to_save after adding tokens: the merged GGUF has the new rows and the adapter's tokens."""
    from transformers import AutoTokenizer

    from tuneport.toolkit.tiny import ADDED_TOKENS

    base, adapter = zoo.base(arch), zoo.adapter(arch, "modules_to_save")
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f32", "--adapter", adapter, "--out", out)
    tok = AutoTokenizer.from_pretrained(adapter)
    ids = IDS[:-2] + tok.convert_tokens_to_ids(ADDED_TOKENS[:2])
    ref = logits(load_peft(base, adapter), torch.tensor([ids]))[0]
    llm = llamacpp_model(out / f"{base.name}-F32.gguf")
    try:
        assert compare_logits(ref, llamacpp_logits(llm, ids)).max_abs <= 1e-4
        # SentencePiece in llama.cpp puts "▁" after a special token (see docs/gguf.md): keep it last there
        text = f"{ADDED_TOKENS[0]} hi {ADDED_TOKENS[2]}" if arch == "qwen2" else f"hi{ADDED_TOKENS[2]}"
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok(text, add_special_tokens=False).input_ids
    finally:
        llm.close()


def test_modelfile_system_is_the_templates_default_system_prompt():
    from tuneport.convert.gguf.modelfile import modelfile

    chatml = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '<|im_start|>system\\n"
              "You are Smol.<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert 'SYSTEM """You are Smol."""' in modelfile("m.gguf", chatml)[0]
    # SmolLM2's bos_token is "<|im_start|>", which opens every turn: the template's text keeps it
    smol = modelfile("m.gguf", chatml, eos="<|im_end|>", bos="<|im_start|>")[0]
    assert 'SYSTEM """You are Smol."""' in smol and 'TEMPLATE """{{ if .System }}<|im_start|>system' in smol
    plain = chatml.replace("{% if loop.first and m['role'] != 'system' %}", "{% if false %}")
    assert "SYSTEM" not in modelfile("m.gguf", plain)[0]
    failing = "{{ raise_exception('no') }}<|im_start|><|im_end|>"
    text, warning = modelfile("m.gguf", failing)
    assert "SYSTEM" not in text and "TEMPLATE" in text and warning is None


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character map: the 256 tokens of a byte-level BPE vocabulary with no merges."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def test_bpe_tokenizer_without_merges_exports_a_loadable_gguf(zoo, tmp_path, cli):
    """A byte-level BPE vocabulary of the byte alphabet and specials, with no merges: llama.cpp needs the
    merges key even when empty ("cannot find tokenizer merges in model file" otherwise); the GGUF loads and
    tokenizes byte by byte as HF does."""
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(zoo.base("qwen2"), base)
    tj = json.loads((base / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tj["added_tokens"]}
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    tj["added_tokens"] = [{**t, "id": 256 + k} for k, t in enumerate(tj["added_tokens"])]
    vocab.update({content: 256 + k for k, content in enumerate(specials)})
    tj["model"]["vocab"], tj["model"]["merges"] = vocab, []
    (base / "tokenizer.json").write_text(json.dumps(tj))
    out = tmp_path / "gguf"
    export(cli, "--base", base, "--quant", "f16", "--out", out)
    tok = AutoTokenizer.from_pretrained(base)
    llm = llamacpp_model(out / f"{base.name}-F16.gguf")
    try:
        for s in ("hello world", "naïve café", "x = 1\n"):
            hf = tok(s).input_ids
            assert llm.tokenize(s.encode(), add_bos=False, special=True) == hf, s
            assert len(hf) == len(s.encode())  # no merges: one token per byte
    finally:
        llm.close()


def test_an_export_llamacpp_cannot_load_is_refused_and_leaves_nothing(zoo, tmp_path, cli, monkeypatch):
    """The load check before the final rename: a vocabulary written without its merges (the bug above, put
    back) is exit 2 with llama.cpp's own reason, and nothing at the output path."""
    from tuneport.convert.gguf.vocab import GGUFVocab

    write = GGUFVocab.write

    def without_merges(self, writer):
        self.merges = None
        write(self, writer)

    monkeypatch.setattr(GGUFVocab, "write", without_merges)
    out = tmp_path / "gguf"
    err = refused(cli, out, "--base", zoo.base("qwen2"), "--quant", "f16",
                  expect="llama.cpp cannot load the exported qwen2-fp32-F16.gguf: error loading model vocabulary: "
                  "cannot find tokenizer merges in model file")
    assert not list(tmp_path.glob(".tuneport-tmp-*")), err


def test_the_manifest_records_the_load_check(zoo, tmp_path, cli):
    out = tmp_path / "gguf"
    res = export(cli, "--base", zoo.base("llama"), "--quant", "f16,q8_0", "--adapters", "separate",
                 "--adapter", f"plain={zoo.adapter('llama', 'plain')}", "--out", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["load_check"] == "loaded by llama.cpp: 2 model(s), 1 adapter(s)", (res, manifest.keys())


def test_a_sentencepiece_tokenizer_saved_without_its_model_file_exports_the_same_vocabulary(zoo, tmp_path, cli):
    """transformers 5 saves a SentencePiece tokenizer as tokenizer.json + tokenizer_config.json only: the GGUF
    vocabulary written from that equals the one written beside tokenizer.model (every token, type, score and
    tokenizer key), and llama.cpp tokenizes the battery as transformers does."""
    from transformers import AutoTokenizer

    from tuneport.convert.gguf.read import open_gguf

    base = tmp_path / "base"
    shutil.copytree(zoo.base("llama"), base)
    saved = tmp_path / "saved"
    shutil.copytree(base, saved)
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (saved / f).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(saved)
    assert not (saved / "tokenizer.model").exists() and (saved / "tokenizer.json").exists()
    fields = []
    for model in (base, saved):
        res = export(cli, "--base", model, "--quant", "f32", "--out", tmp_path / f"{model.name}-gguf")
        assert res["tokenizer_check"]["passed"], res["tokenizer_check"]
        reader = open_gguf(next((tmp_path / f"{model.name}-gguf").glob("*.gguf")))
        fields.append({k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")})
    assert fields[0] == fields[1]
