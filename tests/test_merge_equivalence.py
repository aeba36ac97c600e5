"""Every adapter variant on every arch: the merged HF dir in transformers equals PEFT, merged and not."""

from __future__ import annotations

import json
from importlib import metadata as _metadata

import pytest
import torch
from conftest import ARCHS
from packaging import version as _version

import tuneport
from tuneport.convert.arch import known_arch
from tuneport.convert.support_matrix import supported
from tuneport.toolkit.fidelity import adapter_vocab, load_hf, load_peft, logits
from tuneport.toolkit.tiny import TINY_ARCHS, VARIANTS
from tuneport.toolkit.tiny.adapters import MOE_VARIANTS

TOL = 1e-4
# Qwen3.5-MoE: its recurrent layers and routing carry fp32's order of operations past 1e-4 — merged vs unmerged PEFT
# 1.47e-4 measured with one torch thread (as `make test` runs each xdist worker) on an AMD EPYC, under 1e-4 with two
RECURRENT_MOE_TOL = 2e-4


def tol(arch: str) -> float:
    return RECURRENT_MOE_TOL if arch.startswith("qwen3_5_moe") else TOL


@pytest.mark.parametrize("arch", supported("merge"))
def test_every_architecture_merges_like_peft(zoo, tmp_path, ids, arch):
    """Every architecture of the table (fused modules included): an adapter on all linears, merged, equals PEFT."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, "all_linear")
    tuneport.merge(base=base, adapters=[adapter], out=tmp_path / "merged")
    merged = logits(load_hf(tmp_path / "merged"), ids)
    unmerged = logits(load_peft(base, adapter), ids)
    assert (merged - unmerged).abs().max().item() <= tol(arch)
    assert (unmerged - logits(load_hf(base), ids)).abs().max().item() > 0.1


MOE = [a for a in supported("merge") if (spec := known_arch(a)) is not None and spec.experts is not None]


# PEFT 0.21 loads a transformers 4 per-expert adapter over transformers 5's fused experts by mapping its
# target_modules (gate_proj, up_proj, down_proj) onto them, but on Qwen2-MoE those names also match the shared
# expert's plain linears: it attaches LoRA there and silently drops every expert's weights (measured: logits 3.6
# apart from tuneport's merge, which applies them as transformers 4 trained them; the shared expert's and q_proj's
# LoRA alone agree to 3e-6). No reference to compare with.
MOE_UNREFERENCED = {("qwen2_moe", "per_expert"): "PEFT 0.21 drops a per-expert adapter's expert weights on Qwen2-MoE "
                    "(its target names match the shared expert first)",
                    # the same shared-expert names; and Qwen3.5 came after transformers 4, so no such adapter exists
                    **{(a, "per_expert"): "PEFT 0.21 drops a per-expert adapter's expert weights on Qwen3.5-MoE (its "
                       "target names match the shared expert first)" for a in ("qwen3_5_moe_text", "qwen3_5_moe")},
                    ("gpt_oss", "per_expert"): "gpt-oss came out with its experts fused (transformers 4.55 too): no "
                                               "per-expert adapter of it exists",
                    **{(a, "per_expert"): "Llama 4 came out with its experts fused (transformers 4.51 too): no "
                                          "per-expert adapter of it exists" for a in ("llama4_text", "llama4")}}


def moe_cases(archs: list[str], variants=tuple(MOE_VARIANTS)) -> list:
    """(arch, variant) for mixture-of-experts adapter variants, skipped where PEFT gives no reference."""
    return [pytest.param(a, v, marks=pytest.mark.skip(reason=MOE_UNREFERENCED[a, v])) if (a, v) in MOE_UNREFERENCED
            else (a, v) for a in archs for v in variants]


@pytest.mark.parametrize("arch,variant", moe_cases(MOE))
def test_expert_lora_merges_exactly(zoo, tmp_path, ids, arch, variant):
    """LoRA on the experts, as PEFT trains it over transformers 5's fused parameters (target_parameters) and as
    transformers 4 trained it (one module per expert, which PEFT converts on load): merged = PEFT, merged or not."""
    base, adapter = zoo.base(arch), zoo.adapter(arch, variant)
    tuneport.merge(base=base, adapters=[adapter], out=tmp_path / "merged")
    merged = logits(load_hf(tmp_path / "merged"), ids)
    peft_model = load_peft(base, adapter)
    unmerged = logits(peft_model, ids)
    assert (merged - unmerged).abs().max().item() <= tol(arch)
    assert (merged - logits(peft_model.merge_and_unload(), ids)).abs().max().item() <= tol(arch)
    assert (unmerged - logits(load_hf(base), ids)).abs().max().item() > 0.1


# Variants PEFT itself cannot make on an architecture (so there is no reference to compare with).
UNBUILDABLE = {
    **{("phi3", v): "phi3 fuses q/k/v (qkv_proj): PEFT finds no q_proj or v_proj"
       for v in ("plain", "modules_to_save", "tied", "regex", "layers")},
    ("qwen3_moe", "dora"): "PEFT maps down_proj onto the fused experts, where it has no DoRA",
    ("lfm2", "layers"): "LFM2's layer 1 is a convolution block and its MLP is w1/w2/w3: PEFT finds none of the targets",
    ("granitemoehybrid", "layers"): "Granite 4's layer 1 is a Mamba-2 block and its MLP is input_linear/output_linear: "
                                    "PEFT finds none of the targets",
    **{("qwen3_moe", v): "PEFT maps gate_proj/up_proj onto the fused gate_up_proj and wants both"
       for v in ("tied", "regex", "layers")},
}
# PEFT 0.22 fuses Qwen2-MoE's expert projections as it does Qwen3-MoE's (its _MOE_FUSED_TARGETS), so the same variants
# have no PEFT reference there; with PEFT 0.21 they are built and compared
PEFT_VERSION = _metadata.version("peft")
if _version.parse(PEFT_VERSION) >= _version.parse("0.22"):
    UNBUILDABLE.update({("qwen2_moe", v): f"PEFT {PEFT_VERSION} {why.removeprefix('PEFT ')}"
                        for (a, v), why in list(UNBUILDABLE.items()) if a == "qwen3_moe"})


# Qwen3.5 and Gemma 4 as released differ from their text models (every variant above) in names only: the variants
# that touch names (embeddings, lm_head, a full tensor, all linears) run on them
RENAMED_ONLY = dict.fromkeys(("qwen3_5", "qwen3_5_moe", "gemma4", "llama4"),
                             ("all_linear", "embedding", "tied", "modules_to_save"))


def _variant_cases() -> list:
    """Every (architecture, variant); the default run keeps the three base architectures' (conftest.ARCHS: every
    variant) and leaves the rest of the matrix to the full run (``-m "slow or not slow"``, as ``make test``), where
    test_every_architecture_merges_like_peft still covers each architecture by default (the default-run budget)."""
    return [pytest.param(a, v, marks=pytest.mark.skip(reason=UNBUILDABLE[a, v])) if (a, v) in UNBUILDABLE
            else pytest.param(a, v, marks=pytest.mark.slow) if a not in ARCHS
            else (a, v) for a in supported("merge") if a in TINY_ARCHS for v in VARIANTS
            if v in RENAMED_ONLY.get(a, VARIANTS)]


@pytest.mark.parametrize(("arch", "variant"), _variant_cases())
def test_merge_matches_peft(zoo, tmp_path, ids, arch, variant):
    """Every LoRA variant on every architecture of the table: merged = PEFT unmerged (the trained model), and
    = PEFT's merge_and_unload except where that changes both sides of tied embeddings (see the next test)."""
    base = zoo.base_for(arch, variant)
    adapter = zoo.adapter(arch, variant)
    out = tmp_path / "merged"
    tuneport.merge(base=base, adapters=[adapter], out=out)

    merged = logits(load_hf(out), ids)
    peft_model = load_peft(base, adapter)
    unmerged = logits(peft_model, ids)
    peft_merged = logits(peft_model.merge_and_unload(), ids)
    plain_base = logits(load_hf(base, vocab=adapter_vocab(adapter)), ids)

    assert (merged - unmerged).abs().max().item() <= tol(arch)
    tied_embedding = json.loads((base / "config.json").read_text()).get("tie_word_embeddings") and any(
        "embed_tokens" in m or "lm_head" in m for m in json.loads((adapter / "adapter_config.json").read_text()).get(
            "target_modules") or [])
    if not tied_embedding:
        assert (merged - peft_merged).abs().max().item() <= tol(arch)
    # the adapter must matter, or the comparison proves nothing
    assert (unmerged - plain_base).abs().max().item() > 0.1

    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("text_config") or cfg)["vocab_size"] == merged.shape[-1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "merge" and manifest["outputs"]


def test_tied_base_with_embedding_lora_keeps_trained_behaviour(zoo, tmp_path, ids):
    """PEFT's merge_and_unload changes lm_head too when embeddings are tied; the trained model
    (unmerged) does not. tuneport unties and matches the trained model."""
    base = zoo.base("llama", tied=True)
    from tuneport.toolkit.tiny import make_adapter

    adapter = tmp_path / "emb"
    make_adapter(base, "embedding", adapter)
    out = tmp_path / "merged"
    tuneport.merge(base=base, adapters=[adapter], out=out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    unmerged = logits(load_peft(base, adapter), ids)
    assert (logits(load_hf(out), ids) - unmerged).abs().max().item() <= TOL


def test_weighted_adapters_sum_deltas(zoo, tmp_path, ids, cli):
    """--adapter A:0.5 --adapter B:1.5 gives W + 0.5 ΔA + 1.5 ΔB (deltas taken from PEFT's own merge)."""
    base = zoo.base("llama")
    a, b = zoo.adapter("llama", "plain"), zoo.adapter("llama", "regex")
    out = tmp_path / "merged"
    code, _, err = cli("merge", "--base", base, "--adapter", f"{a}:0.5", "--adapter", f"{b}:1.5", "--out", out)
    assert code == 0, err

    ref = load_hf(base)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    for path, w in ((a, 0.5), (b, 1.5)):
        merged = load_peft(base, path).merge_and_unload().state_dict()
        for k in sd:
            sd[k] += w * (merged[k] - ref.state_dict()[k])
    ref.load_state_dict(sd)
    assert (logits(load_hf(out), ids) - logits(ref, ids)).abs().max().item() <= TOL


def test_dtype_option_casts_output(zoo, tmp_path):
    out = tmp_path / "m16"
    tuneport.merge(base=zoo.base("qwen2"), adapters=[zoo.adapter("qwen2", "plain")], out=out, dtype="fp16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float16"
    model = load_hf(out, dtype=torch.float16)
    assert next(model.parameters()).dtype == torch.float16
