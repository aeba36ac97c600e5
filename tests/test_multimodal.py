"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration): text-only targets export the text model
(parity in tests/test_gguf_export.py and tests/test_mlx_export.py, parametrized from the support matrix); here:
the vision tower is left out with a note, an adapter that changes it is refused; merge keeps the whole model, an
adapter on both towers merged exactly (PEFT's logits with an image in the prompt); vLLM serves the whole model
(images included) merged, and LoRA on its language model separately; the targets that would have to keep it and
cannot prove it refuse the checkpoint with the reason — exit 2, nothing written; AWQ quantizes the language model
and keeps the vision tower."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def vision_adapter(zoo, tmp_path_factory):
    """LoRA on q_proj of both towers."""

    out = tmp_path_factory.mktemp("mm") / "vision-lora"
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo.base("gemma3"), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=r".*(vision_tower|language_model).*\.(q_proj|fc1)",
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def test_merge_keeps_the_vision_tower_and_equals_peft_on_images(zoo, tmp_path, cli, vision_adapter):
    """LoRA on both towers merged into the whole checkpoint (the hub's names kept): with an image in the prompt,
    transformers on the merged directory = PEFT unmerged."""
    from transformers import AutoModelForCausalLM

    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.toolkit.fidelity import load_peft

    base, out = zoo.base("gemma3"), tmp_path / "merged"
    code, _, err = cli("merge", "--base", base, "--adapter", vision_adapter, "--out", out)
    assert code == 0, err
    assert sorted(Checkpoint(out).names()) == sorted(Checkpoint(base).names())  # vision tower and layout kept
    cfg = json.loads((base / "config.json").read_text())
    image = cfg["image_token_index"]
    ids = torch.tensor([[2, 50, cfg["boi_token_index"], *[image] * cfg["mm_tokens_per_image"],
                         cfg["eoi_token_index"], 60, 70, 80]])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    peft = load_peft(base, vision_adapter)
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        got, want, plain = (m(input_ids=ids, pixel_values=pixels).logits for m in (merged, peft, base_model))
    assert (got - want).abs().max().item() <= 1e-4
    assert (want - plain).abs().max().item() > 0.1
    vision_q = next(n for n in Checkpoint(base).names()
                    if n.startswith("vision_tower.") and n.endswith("q_proj.weight"))
    assert not torch.equal(Checkpoint(out).read(vision_q), Checkpoint(base).read(vision_q))  # the vision LoRA merged


def test_text_model_exported_and_vision_tower_left_out_with_a_note(zoo, tmp_path, cli):
    code, out, err = cli("export", "--target", "gguf", "--json", "--base", zoo.base("gemma3"), "--quant", "f32",
                         "--adapters", "separate", "--adapter", f"a={zoo.adapter('gemma3', 'all_linear')}",
                         "--out", tmp_path / "gguf")
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("vision-tower tensors left out" in n for n in notes), notes


def test_adapter_on_the_vision_tower_is_refused_for_text_only_targets(zoo, tmp_path, cli, vision_adapter):
    for target in ("gguf", "mlx"):
        out = tmp_path / target
        code, _, err = cli("export", "--target", target, "--base", zoo.base("gemma3"), "--adapter", vision_adapter,
                           "--out", out)
        assert code == 2 and "changes the vision tower" in err and "Traceback" not in err, err
        assert not out.exists()


def test_exl3_refuses_the_whole_model_with_the_reason(zoo, tmp_path, cli):
    out = tmp_path / "out"
    code, _, err = cli("export", "--target", "exl3", "--base", zoo.base("gemma3"), "--out", out)
    assert code == 2 and not out.exists(), err
    assert "does not export multimodal gemma3" in err or "CUDA" in err, err  # exl3 asks for CUDA first


@pytest.mark.vllm
def test_awq_with_separate_adapters_on_the_whole_model(zoo, tmp_path, cli, vision_adapter, monkeypatch):
    """--target awq --adapters separate: the language-model adapter is written rewritten for the folded scales under
    its own (PEFT) names, and vLLM over the 4-bit whole model gives the KL tuneport's weights give in transformers
    fp32; an adapter on the vision tower is refused (vLLM serves LoRA on the language model only)."""
    import tuneport
    import tuneport.toolkit.verify.dequant_runner as dq
    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.cpu_features import w4a16_cpu_problem

    base, adapter = zoo.base("gemma3"), zoo.adapter("gemma3", "all_linear")
    refused = tmp_path / "refused"
    code, _, err = cli("export", "--target", "awq", "--base", base, "--adapters", "separate",
                       "--adapter", f"v={vision_adapter}", "--out", refused)
    assert code == 2 and "LoRA on the vision tower" in err and not refused.exists(), err
    out = tmp_path / "awq"
    code, _, err = cli("export", "--target", "awq", "--base", base, "--adapters", "separate", "--adapter",
                       f"a={adapter}", "--group-size", "32", "--calib-samples", "8", "--calib-seqlen", "64",
                       "--out", out)
    assert code == 0, err
    written, original = load_adapter(out / "adapters" / "a", "w"), load_adapter(adapter, "a")
    assert written.modules.keys() == original.modules.keys()  # transformers 5's names, as vLLM maps them
    assert any(not torch.equal(written.modules[k].A, m.A) for k, m in original.modules.items())
    if problem := w4a16_cpu_problem(json.loads((out / "config.json").read_text())):
        pytest.skip(f"vLLM cannot run 4-bit here: {problem}")
    kw = dict(artifact=out, reference=base, adapter=adapter, lora=out / "adapters" / "a", tokens=64,
              default_gates=False)
    real = tuneport.verify(**kw)
    monkeypatch.setattr(dq, "w4a16_cpu_problem", lambda *_: "simulated")
    exact = tuneport.verify(**kw)
    assert real.engine == "vLLM" and exact.engine.startswith("transformers")
    assert real.metrics["kl"] == pytest.approx(exact.metrics["kl"], rel=0.1) and exact.metrics["kl"] < 0.25


def test_vllm_bundle_refuses_lora_on_the_vision_tower(zoo, tmp_path, cli, vision_adapter):
    out = tmp_path / "bundle"
    code, _, err = cli("export", "--target", "vllm", "--base", zoo.base("gemma3"), "--adapters", "separate",
                       "--adapter", f"v={vision_adapter}", "--out", out)
    assert code == 2 and "LoRA on the vision tower" in err and "use --adapters merge" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_vllm_export_writes_the_tower_as_vllm_loads_it(zoo, tmp_path, cli):
    """transformers 5 saves SigLIP without its ``vision_model`` level, which vLLM 0.32 cannot load: the bundle has
    the hub's layout, every tensor bit-equal, and transformers loads it as the base."""
    from transformers import AutoModelForCausalLM

    from tuneport.convert.checkpoint import Checkpoint

    base = zoo.base("gemma3")
    assert any(n.startswith("vision_tower.embeddings.") for n in Checkpoint(base).names())
    out = tmp_path / "bundle"
    code, _, err = cli("export", "--target", "vllm", "--base", base, "--adapters", "separate",
                       "--adapter", f"a={zoo.adapter('gemma3', 'all_linear')}", "--out", out)
    assert code == 0, err
    src, got = Checkpoint(base), Checkpoint(out / "base")
    assert sorted(got.names()) == sorted(n.replace("vision_tower.", "vision_tower.vision_model.")
                                         for n in src.names())
    for name in src.names():
        assert torch.equal(got.read(name.replace("vision_tower.", "vision_tower.vision_model.")), src.read(name))
    a = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


N_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3  # fp32 in both; vLLM's CPU kernels sum in another order


@torch.no_grad()
def greedy_with_image(model, processor, text: str, image) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities, the image (or None) in the prompt as the processor puts it."""
    enc = processor(text=[text], images=[[image]] if image is not None else None, return_tensors="pt")
    ids, extra = enc["input_ids"], ({"pixel_values": enc["pixel_values"]} if image is not None else {})
    toks, logprobs = [], []
    for _ in range(N_TOKENS):
        logits = model(input_ids=ids, **extra).logits[0, -1].float().log_softmax(-1)
        tok = int(logits.argmax())
        toks.append(tok)
        logprobs.append(float(logits[tok]))
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return toks, logprobs


@pytest.mark.vllm
def test_vllm_serves_the_whole_model_with_images_like_peft(zoo, tmp_path, cli, vision_adapter):
    """vLLM (CPU, fp32) on tuneport's bundles, prompts with and without an image: the merged model (LoRA on both
    towers) and the base + a language-model LoRA served separately give PEFT's greedy tokens, log-probabilities
    within 1e-3."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from vllm_runner_client import run_vllm_jobs

    from tuneport.toolkit.fidelity import load_hf, load_peft

    base, text_adapter = zoo.base("gemma3"), zoo.adapter("gemma3", "all_linear")
    image = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((40, 52, 3)) * 255).astype("uint8")).save(image)
    texts = ["Describe <start_of_image> in a word:", "def add(a, b):"]
    images = [str(image), None]
    merged, bundle = tmp_path / "merged", tmp_path / "bundle"
    code, _, err = cli("export", "--target", "vllm", "--base", base, "--adapter", vision_adapter, "--out", merged)
    assert code == 0, err
    code, _, err = cli("export", "--target", "vllm", "--base", base, "--adapters", "separate",
                       "--adapter", f"a={text_adapter}", "--out", bundle)
    assert code == 0, err
    processor = AutoProcessor.from_pretrained(base)
    pil = [Image.open(i).convert("RGB") if i else None for i in images]

    def reference(model):
        return [greedy_with_image(model, processor, t, i) for t, i in zip(texts, pil, strict=True)]

    want_merged = reference(load_peft(base, vision_adapter))
    want_base = reference(load_hf(base))
    want_text = reference(load_peft(base, text_adapter))
    assert want_merged != want_base and want_text != want_base
    job = {"texts": texts, "images": images, "max_tokens": N_TOKENS}
    got_merged, got_bundle = run_vllm_jobs([{**job, "model": str(merged)}, {**job, "bundle": str(bundle)}], tmp_path)
    for got_toks, got_lps, want in ((got_merged[""], got_merged["logprobs"], want_merged),
                                    (got_bundle["a"], got_bundle["logprobs"]["a"], want_text)):
        assert got_toks == [w[0] for w in want]
        worst = max(abs(g - w) for lps, (_, wl) in zip(got_lps, want, strict=True)
                    for g, w in zip(lps, wl, strict=True))
        print(f"vLLM - PEFT greedy log-probabilities, worst: {worst:.2e}")
        assert worst <= LOGPROB_TOLERANCE, worst


@pytest.mark.vllm
def test_serve_vllm_on_the_exported_base_like_peft(zoo, tmp_path):
    """tuneport serve --engine vllm: a base as transformers 5 saves it is refused before vLLM starts (it could not
    load the tower); the base of tuneport's bundle serves base and adapter traffic with PEFT's greedy tokens."""
    import httpx
    from transformers import AutoTokenizer

    import tuneport
    from tuneport.convert.errors import UserError
    from tuneport.toolkit.fidelity import greedy, load_hf, load_peft

    base, adapter = zoo.base("gemma3"), zoo.adapter("gemma3", "all_linear")
    with pytest.raises(UserError, match="vision tower as transformers 5 saves it"):
        tuneport.serve(base=base, adapters={"a": adapter}, engine="vllm", port=0)
    bundle = tmp_path / "bundle"
    tuneport.export(base=base, target="vllm", out=bundle, adapters=[f"a={adapter}"], adapter_mode="separate")
    prompt = "def add(a, b):"
    ids = AutoTokenizer.from_pretrained(base)(prompt).input_ids
    want = {"a": greedy(load_peft(base, adapter), ids, N_TOKENS), "base": greedy(load_hf(base), ids, N_TOKENS)}
    # fp32 as the reference: vLLM's "auto" runs an fp32 checkpoint in bf16, where this prompt's 8th token (PEFT's
    # margin 0.022 over the runner-up) flips
    server = tuneport.serve(base=bundle / "base", adapters={"a": adapter}, engine="vllm", max_adapters=2,
                            dtype="fp32", max_model_len=256, vllm_args=["--enforce-eager"],
                            log_file=tmp_path / "vllm.log", port=0)
    try:
        got = {}
        for model in ("a", "base", "a"):
            r = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            got[model] = r.json()["choices"][0]["token_ids"]
    finally:
        server.close()
    assert got == want


@pytest.mark.vllm
def test_verify_the_vllm_bundle(zoo, tmp_path):
    """tuneport verify runs the bundle in vLLM against base + PEFT: every gate passes (the eval text is cut to the
    text model's positions, which a multimodal config keeps in text_config)."""
    import tuneport

    base, adapter = zoo.base("gemma3"), zoo.adapter("gemma3", "all_linear")
    bundle = tmp_path / "bundle"
    tuneport.export(base=base, target="vllm", out=bundle, adapters=[f"a={adapter}"], adapter_mode="separate")
    report = tuneport.verify(artifact=bundle, reference=base, adapter=adapter, lora=bundle / "adapters" / "a")
    assert report.passed, report.failure_line()
    assert report.metrics["kl"] <= 1e-6 and report.metrics["greedy"] == 1.0, report.metrics


@pytest.mark.vllm
def test_awq_keeps_the_vision_tower_and_vllm_runs_it_with_images(zoo, tmp_path, cli, vision_adapter):
    """--target awq on the whole model, LoRA on both towers merged: the language model's linears 4-bit, the vision
    tower kept 16-bit (in vLLM's layout), equal to tuneport merge's vision tower in bf16; vLLM (W4A16, bf16) reads
    prompts with an image as tuneport's dequantized weights do in transformers fp32: each prompt token's
    log-probability (teacher-forced, so that a near tie of the tiny model cannot send the two down different paths)
    within bf16's noise, measured mean 0.04, worst 0.22 (transformers itself in bf16: worst 0.05). The tiny vision
    tower moves these log-probabilities less than that noise, so the fp32 test above is what proves vLLM's vision
    path; this one proves the 4-bit model with its 16-bit tower loads and runs images in vLLM."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor
    from vllm_runner_client import run_vllm_jobs

    from tuneport.convert.checkpoint import Checkpoint
    from tuneport.convert.cpu_features import w4a16_cpu_problem
    from tuneport.toolkit.verify.dequant_runner import dequantized_state, memory_names

    base, out = zoo.base("gemma3"), tmp_path / "awq"
    code, _, err = cli("export", "--target", "awq", "--base", base, "--adapter", vision_adapter, "--group-size", "32",
                       "--calib-samples", "8", "--calib-seqlen", "64", "--out", out)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    names = set(Checkpoint(out).names())
    assert "language_model.model.layers.0.self_attn.q_proj.weight_packed" in names
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in names
    assert "re:.*vision_tower.*" in cfg["quantization_config"]["ignore"]
    merged = tmp_path / "merged"
    code, _, err = cli("merge", "--base", base, "--adapter", vision_adapter, "--out", merged)
    assert code == 0, err
    whole, awq = Checkpoint(merged), Checkpoint(out)
    vision = [n for n in whole.names() if n.startswith("vision_tower.")]
    assert vision and all(torch.equal(awq.read(n.replace("vision_tower.", "vision_tower.vision_model.")),
                                      whole.read(n).bfloat16()) for n in vision)
    if problem := w4a16_cpu_problem(cfg):
        pytest.skip(f"vLLM cannot run 4-bit here: {problem}")
    image = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((40, 52, 3)) * 255).astype("uint8")).save(image)
    texts = ["Describe <start_of_image> in a word: it is a picture of the sea", "def add(a, b): return a + b"]
    images = [str(image), None]
    plain, state = dequantized_state(out)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**plain), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(memory_names("gemma3", model, state), strict=False)
    assert not unexpected and missing == ["lm_head.weight"]  # tied
    model.tie_weights()
    model.eval()
    processor = AutoProcessor.from_pretrained(base)
    got = run_vllm_jobs([{"model": str(out), "texts": texts, "images": images, "max_tokens": 1, "dtype": "bfloat16",
                          "prompt_logprobs": True}], tmp_path)[0]["prompt"]
    diffs: list[float] = []
    for text, img, (vllm_ids, vllm_lps) in zip(texts, images, got, strict=True):
        enc = processor(text=[text], images=[[Image.open(img).convert("RGB")]] if img else None, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == vllm_ids  # the image expanded alike
        extra = {"pixel_values": enc["pixel_values"]} if img else {}
        with torch.no_grad():
            lps = model(input_ids=enc["input_ids"], **extra).logits[0].float().log_softmax(-1)
        want = [float(lps[i - 1, t]) for i, t in enumerate(vllm_ids) if i]
        diffs += [abs(g - w) for g, w in zip(vllm_lps[1:], want, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"AWQ gemma3, prompts with an image: vLLM bf16 vs tuneport's weights fp32, log-probabilities mean "
          f"{mean:.3f}, worst {max(diffs):.3f}")
    assert mean < 0.1 and max(diffs) < 0.5, (mean, max(diffs))


@pytest.mark.vllm
def test_an_adapter_over_the_awq_whole_model_is_rewritten_for_its_scales(zoo, tmp_path, monkeypatch):
    """A PEFT adapter (transformers 5's names) over the AWQ export of the whole model: the scales AWQ folded are
    found under the checkpoint's names and the adapter rewritten for them, so vLLM's KL to base + PEFT equals that
    of tuneport's dequantized weights + the rewritten adapter in transformers fp32 (measured 0.0550 vs 0.0552)."""
    import tuneport
    import tuneport.toolkit.verify.dequant_runner as dq
    from tuneport.convert.adapter import load_adapter
    from tuneport.convert.awq.adapters import read_scales, rescale_adapter
    from tuneport.convert.cpu_features import w4a16_cpu_problem

    base, adapter = zoo.base("gemma3"), zoo.adapter("gemma3", "all_linear")
    out = tuneport.export(base=base, target="awq", out=tmp_path / "awq", group_size=32, calib_samples=8,
                          calib_seqlen=64).out
    scales = read_scales(out)
    assert scales and all(m.startswith("language_model.model.layers.") for m in scales)
    lora = load_adapter(adapter, "a")
    rewritten = rescale_adapter(lora, scales)
    assert sum(not torch.equal(m.A, rewritten.modules[k].A) for k, m in lora.modules.items()) >= len(scales) // 2
    if problem := w4a16_cpu_problem(json.loads((out / "config.json").read_text())):
        pytest.skip(f"vLLM cannot run 4-bit here: {problem}")
    real = tuneport.verify(artifact=out, reference=base, adapter=adapter, lora=adapter, tokens=64,
                           default_gates=False)
    monkeypatch.setattr(dq, "w4a16_cpu_problem", lambda *_: "simulated")
    exact = tuneport.verify(artifact=out, reference=base, adapter=adapter, lora=adapter, tokens=64,
                            default_gates=False)
    print(f"adapter over the 4-bit gemma3: vLLM KL {real.metrics['kl']:.4f}, "
          f"tuneport's weights {exact.metrics['kl']:.4f}")
    assert real.engine == "vLLM" and exact.engine.startswith("transformers")
    assert real.metrics["kl"] == pytest.approx(exact.metrics["kl"], rel=0.1) and exact.metrics["kl"] < 0.25
