"""Real ``config.json`` files (tests/real/, each file's source in its README): for each, a tiny model with the same
keys and values except sizes (``tuneport.toolkit.tiny.real``) and an all-linear LoRA on it, exported through every
target and compared as the column tests compare, or refused for a real reason, which the test asserts:

- merge: tuneport's merged model = PEFT (fp32, max |Δlogit| <= 1e-4);
- gguf: the F32 GGUF in llama.cpp = transformers, and its GGUF LoRA = PEFT (1e-4; Gemma 5e-3, llama.cpp's fp16
  GELU table);
- mlx: the MLX model in mlx-lm = transformers, and its mlx-lm adapter = PEFT (1e-4);
- vllm: the bundle (base + adapter) in vLLM, greedy tokens = PEFT's (``test_vllm_serves_every_real_config``).

The table of outcomes (file x target) is printed at the end of the run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, load_peft, logits

REAL = Path(__file__).parent / "real"
SOURCES = json.loads((REAL / "sources.json").read_text())
CONFIGS = {p.parent.name: p for p in sorted(REAL.glob("*/*/config.json"))}
TARGETS = ("merge", "gguf", "mlx")
COLUMNS = (*TARGETS, "vllm")  # the printed table
IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]
# llama.cpp evaluates GELU through an fp16 table (test_gguf_export.py: 5e-3 on the tiny Gemmas, 1.05e-2 with a real
# config's six layers): Gemma's GGUFs are compared with a reference that computes GELU through the same table
# (tests_helpers.llamacpp_gelu): 2.6e-3 and 1.3e-3 are left (its SIMD paths), within the column test's 5e-3
TABLE_GELU = ("gemma2", "gemma3_text", "gemma3", "gemma4_text", "gemma4")
TOL = dict.fromkeys(TABLE_GELU, 5e-3)
# Where fp32's order of operations alone moves the logits past 1e-4 (on the Qwen3.6-MoE config PEFT's own
# merge_and_unload lands 1.45e-3 from unmerged PEFT: its recurrent layers and routing carry the rounding; the F32 GGUF
# base stays 5.6e-5 from transformers, its GGUF LoRA 7.3e-4 from PEFT): tuneport's merge is held to PEFT's
# merge_and_unload at 1e-4, and every target to PEFT at this
# Gemma 4 E2B's real config (10 layers, per-layer inputs, shared KV): transformers' fp32 logits are 1.3e-4 from its own
# float64 ones, the MLX export's 4.0e-5 (so 1.2e-4 apart, the fp32 reference's rounding)
FOLDED_APART = {"qwen3_5_moe": 2e-3, "gemma4": 2e-4}

# Where a real config is refused: (file's folder, target) -> a piece of the one-line reason. Every other cell is
# exported and compared.
QUANTIZED = "is quantized"
REFUSED: dict[tuple[str, str], str] = {
    ("microsoft--Phi-4-mini-instruct", "mlx"): "mlx-lm's SuScaledRoPE rotates with LongRoPE's long factors at every "
                                               "length",
    ("google--gemma-2-9b-it", "mlx"): "mlx-lm's Gemma 2 has no sliding window",
    ("ibm-granite--granite-4.0-h-small", "gguf"): "does not export Granite 4's routed experts yet",
    ("peft--phi-3-mini-merged", "mlx"): "uses a sliding window of 2047 tokens, which mlx-lm does not implement",
    **{(name, t): QUANTIZED for name in ("axolotl--llama2-7b-qlora", "peft--tinyllama-merged-keeps-bnb-quant",
                                         "mlx-lm--llama-3.2-1b-fused", "mistralai--Devstral-Small-2-24B-Instruct")
       for t in TARGETS},
}
OUTCOMES: dict[tuple[str, str], str] = {}
# Where a real config exports only with a key accepted (--accept-config-key): (the flag, the config llama.cpp computes
# with instead). gpt-oss's YaRN is untruncated, which llama.cpp cannot express (convert/gguf/config_rules.py:
# YARN_UNTRUNCATED), nor mlx-lm's YarnRoPE: the GGUF and the MLX model are held to transformers computing with truncate:
# true (1e-4), and their distance from the real config's transformers is measured and printed (6e-3 over the tests'
# 16 positions, growing with the position)
ACCEPTED_KEYS: dict[tuple[str, str], tuple[list[str], dict]] = {
    ("unsloth--gpt-oss-20b-merged", t): (["--accept-config-key", "rope_parameters"],
                                         {"rope_scaling": {"truncate": True}}) for t in ("gguf", "mlx")}


@pytest.fixture(scope="module", autouse=True)
def _table(summary):
    yield
    if OUTCOMES:
        rows = sorted({n for n, _ in OUTCOMES})
        lines = ["real configs (tests/real): file | " + " | ".join(COLUMNS)]
        lines += [f"  {n} | " + " | ".join(OUTCOMES.get((n, t), "-") for t in COLUMNS) for n in rows]
        summary.append("\n".join(lines))


def test_every_file_has_its_source():
    listed = {d["file"] for d in SOURCES}
    present = {p.relative_to(REAL).as_posix() for p in REAL.rglob("*") if p.is_file()
               and p.name not in ("README.md", "sources.json")}
    assert present == listed, (present - listed, listed - present)
    readme = (REAL / "README.md").read_text()
    assert all(f"`{f}`" in readme for f in listed)
    assert len([f for f in listed if f.endswith((".json", ".jinja"))]) >= 40


def build(name: str, root: Path) -> tuple[Path | None, str | None]:
    """The tiny base for ``name`` (None and the reason when transformers itself cannot build the config)."""
    from tuneport.toolkit.tiny.real import make_base_like

    real = json.loads(CONFIGS[name].read_text())
    try:
        return make_base_like(real, root / name), None
    except Exception as e:  # noqa: BLE001 - transformers refuses the config: recorded, the targets refuse too
        return None, f"{type(e).__name__}: {e}"


def _adapter(base: Path, root: Path) -> Path | None:
    from tuneport.toolkit.tiny.adapters import make_adapter

    try:
        return make_adapter(base, "all_linear", root / "adapter")
    except Exception:  # noqa: BLE001 - an architecture PEFT cannot target: the export refuses it
        return None


def _refusal(code: int, err: str, out: Path) -> str:
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    return err.strip().removeprefix("error: ")


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_real_config_exports_or_is_refused_for_a_reason(name, tmp_path, cli):
    base, why = build(name, tmp_path)
    if base is None:
        for target in TARGETS:
            assert (name, target) in REFUSED, f"transformers cannot build {name}: {why}"
            OUTCOMES[name, target] = "refused (transformers)"
        return
    adapter = _adapter(base, tmp_path)
    model_type = json.loads((base / "config.json").read_text())["model_type"]
    for target in TARGETS:
        out = tmp_path / target
        args = {"merge": ["merge", "--base", base, "--out", out, "--adapter", adapter],
                "gguf": ["export", "--target", "gguf", "--base", base, "--quant", "f32", "--adapters", "separate",
                         "--adapter", f"a={adapter}", "--out", out],
                "mlx": ["export", "--target", "mlx", "--base", base, "--adapters", "separate",
                        "--adapter", f"a={adapter}", "--out", out]}[target]
        accepted, computed = ACCEPTED_KEYS.get((name, target), ([], {}))
        code, _, err = cli(*args, *accepted)
        if (name, target) in REFUSED:
            reason = _refusal(code, err, out)
            assert REFUSED[name, target] in reason, reason
            OUTCOMES[name, target] = "refused: " + reason.replace(str(tmp_path), "")[:70]
            continue
        assert code == 0, f"{name} --target {target}: {err}"
        if computed:  # held to what the engine computes; how far that is from the real config, measured
            as_engine = tmp_path / f"{target}-as-engine"
            _config_variant(base, as_engine, computed)
            worst = compare(target, as_engine, adapter, out, model_type)
            apart = compare(target, base, adapter, out, model_type, tol=1.0)
            OUTCOMES[name, target] = f"= (max|d| {worst:.1e}; {apart:.1e} from the real config: accepted key)"
            continue
        OUTCOMES[name, target] = f"= (max|d| {compare(target, base, adapter, out, model_type):.1e})"


def _config_variant(base: Path, out: Path, patch: dict) -> None:
    """``base`` (linked, not copied) with ``patch`` merged into its config.json's objects."""
    out.mkdir()
    for f in base.iterdir():
        (out / f.name).symlink_to(f)
    cfg = json.loads((base / "config.json").read_text())
    for key, value in patch.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(cfg))


def compare(target: str, base: Path, adapter: Path, out: Path, model_type: str, tol: float | None = None) -> float:
    """The export's worst max |Δlogit| against transformers / PEFT (asserted within the column's tolerance)."""
    import contextlib

    from tests_helpers import llamacpp_gelu

    tol = tol or max(TOL.get(model_type, 1e-4) if target == "gguf" else 1e-4, FOLDED_APART.get(model_type, 0.0))
    ids = torch.tensor([IDS])
    table = llamacpp_gelu() if target == "gguf" and model_type in TABLE_GELU else contextlib.nullcontext()
    with torch.no_grad(), table:
        ref_base, ref_peft = logits(load_hf(base), ids)[0], logits(load_peft(base, adapter), ids)[0]
    if target == "merge":
        merged = logits(load_hf(out), ids)[0]
        found = [compare_logits(ref_peft, merged)]
        if model_type in FOLDED_APART:  # fp32's order of operations: the fold is checked against PEFT's own
            with torch.no_grad():
                folded = logits(load_peft(base, adapter).merge_and_unload(), ids)[0]
            assert compare_logits(folded, merged).max_abs <= 1e-4
    elif target == "gguf":
        model = next(out.glob("*-F32.gguf"))
        found = []
        for lora, ref in ((None, ref_base), (out / "adapters" / "a-F32.gguf", ref_peft)):
            llm = llamacpp_model(model, lora)
            try:
                found.append(compare_logits(ref, llamacpp_logits(llm, IDS)))
            finally:
                llm.close()
    else:
        from tuneport.toolkit.verify.mlx_runner import load_mlx, mlx_logits

        found = [compare_logits(ref_base, mlx_logits(load_mlx(out)[0], IDS)),
                 compare_logits(ref_peft, mlx_logits(load_mlx(out, out / "adapters" / "a")[0], IDS))]
    worst = max(c.max_abs for c in found)
    assert worst <= tol, f"{target}: max |Δlogit| {worst:.2e} > {tol}"
    return worst


def test_the_unsloth_saved_config_exports_to_gguf_and_mlx(tmp_path, cli):
    """Before the audit judged keys by what transformers reads, ``unsloth_version`` alone made --target gguf and
    mlx exit 2; it is inert: both export, numbers within the column tolerances, the key named in the notes."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("mlx_lm")
    name = "unsloth--llama-3.2-1b-instruct-merged"
    base, why = build(name, tmp_path)
    assert base is not None, why
    assert json.loads((base / "config.json").read_text())["unsloth_version"] == "2026.4.2"
    adapter = _adapter(base, tmp_path)
    for target, extra in (("gguf", ["--quant", "f32"]), ("mlx", [])):
        out = tmp_path / target
        code, stdout, err = cli("export", "--target", target, "--base", base, "--adapters", "separate",
                                "--adapter", f"a={adapter}", "--out", out, "--json", *extra)
        assert code == 0, err
        assert "config keys transformers' llama model does not read (inert): unsloth_version" in \
            json.loads(stdout)["notes"]
        compare(target, base, adapter, out, "llama")
    shutil.rmtree(tmp_path)


# A key of a real config flipped: (file, what changes, {target: "=" parity | "refused: <piece>"})
FLIPS = [
    ("meta-llama--Llama-3.2-1B-Instruct", {"attention_bias": True}, {"gguf": "=", "mlx": "="}),
    ("meta-llama--Llama-3.2-1B-Instruct", {"tie_word_embeddings": False}, {"gguf": "=", "mlx": "="}),
    ("Qwen--Qwen2.5-7B-Instruct", {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}}, {"gguf": "="}),
    ("Qwen--Qwen2.5-7B-Instruct", {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     {"gguf": "refused: RoPE types llama.cpp runs for qwen2"}),
    ("Qwen--Qwen2.5-7B-Instruct", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     {"mlx": "refused: mlx-lm's qwen2 has no sliding window (a window of 8 tokens)"}),
    ("google--gemma-2-9b-it", {"final_logit_softcapping": None},
     {"gguf": "refused: llama.cpp always soft-caps Gemma 2's logits"}),
    ("google--gemma-2-9b-it", {"attn_logit_softcapping": 20.0}, {"gguf": "="}),
    ("Qwen--Qwen3-30B-A3B", {"norm_topk_prob": False},
     {"gguf": "refused: renormalizes the chosen experts' weights", "mlx": "="}),
]


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize(("name", "flip", "expect"), FLIPS,
                         ids=[f"{n.split('--')[1]}-{'-'.join(f)}" for n, f, _ in FLIPS])
def test_flipping_a_key_of_a_real_config_changes_the_verdict_as_it_should(name, flip, expect, tmp_path, cli):
    """The keys that matter, on real configs: each flip is carried (the export still equals transformers, which
    now computes differently) or refused with the engine's reason."""
    from tuneport.toolkit.tiny.real import make_base_like

    real = {**json.loads(CONFIGS[name].read_text()), **flip}
    base = make_base_like(real, tmp_path / name)
    adapter = _adapter(base, tmp_path)
    for target, outcome in expect.items():
        out = tmp_path / target
        extra = ["--quant", "f32"] if target == "gguf" else []
        code, _, err = cli("export", "--target", target, "--base", base, "--adapters", "separate",
                           "--adapter", f"a={adapter}", "--out", out, *extra)
        if outcome.startswith("refused"):
            assert outcome.split(": ", 1)[1] in _refusal(code, err, out)
        else:
            assert code == 0, err
            compare(target, base, adapter, out, real["model_type"])


def _vllm_cases() -> list[str]:
    """One real config per model_type vLLM serves (the first in file order), Phi-4-mini's LongRoPE, and Unsloth's
    gpt-oss (its MXFP4 experts read, the adapter merged: a mixture of experts)."""
    from tuneport.convert.support_matrix import supported

    chosen: dict[str, str] = {}
    for name, path in CONFIGS.items():
        model_type = json.loads(path.read_text())["model_type"]
        if model_type in supported("vllm") and not any((name, t) in REFUSED for t in ("merge", "gguf")):
            chosen.setdefault(model_type, name)
    return sorted({*chosen.values(), "microsoft--Phi-4-mini-instruct", "unsloth--gpt-oss-20b-merged"})


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_every_real_config_like_peft(tmp_path, cli):
    """The vLLM column on real configs, one vLLM process for all: each bundle (base + an all-linear adapter; a
    mixture of experts merged, since vLLM's CPU build runs no LoRA on fused experts) gives transformers' and PEFT's
    greedy tokens."""
    from test_vllm_export import N_TOKENS, prompt_ids, run_vllm

    from tuneport.convert.arch import known_arch
    from tuneport.toolkit.fidelity import greedy

    jobs, want = [], []
    for name in _vllm_cases():
        base, why = build(name, tmp_path)
        assert base is not None, why
        adapter = _adapter(base, tmp_path / name)
        out = tmp_path / f"{name}-vllm"
        moe = (spec := known_arch(json.loads((base / "config.json").read_text())["model_type"])) and spec.experts
        mode = "merge" if moe else "separate"
        code, _, err = cli("export", "--base", base, "--target", "vllm", "--adapters", mode, "--adapter",
                           f"a={adapter}", "--out", out)
        assert code == 0, f"{name}: {err}"
        prompts = prompt_ids(base)
        if moe:
            jobs.append({"model": str(out), "prompts": prompts, "max_tokens": N_TOKENS})
            want.append({"": [greedy(load_peft(base, adapter), p, N_TOKENS) for p in prompts]})
        else:
            jobs.append({"bundle": str(out), "prompts": prompts, "max_tokens": N_TOKENS, "with_base": True})
            want.append({"": [greedy(load_hf(base), p, N_TOKENS) for p in prompts],
                         "a": [greedy(load_peft(base, adapter), p, N_TOKENS) for p in prompts]})
    got = run_vllm(jobs, tmp_path)
    for name, g, w in zip(_vllm_cases(), got, want, strict=True):
        assert {k: g[k] for k in w} == w, name
        OUTCOMES[name, "vllm"] = "= (greedy tokens)"
