"""bf16 base: merged in fp32 and cast once, bitwise equal to PEFT's fp32 merge cast to bf16."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import tuneport
from tuneport.toolkit.fidelity import load_peft


def _load_dir(path):
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def test_bf16_merge_is_bitwise_close_to_peft_fp32_merge(zoo, tmp_path):
    base = zoo.base("llama", dtype="bf16")
    adapter = zoo.adapter("llama", "all_linear", dtype="bf16")
    out = tmp_path / "merged"
    tuneport.merge(base=base, adapters=[adapter], out=out)
    ours = _load_dir(out)

    ref = load_peft(base, adapter, dtype=torch.float32).merge_and_unload().state_dict()
    base_sd = _load_dir(base)
    total = equal = moved = 0
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16, name
        r = ref[name].to(torch.bfloat16)
        total += t.numel()
        equal += (t.view(torch.int16) == r.view(torch.int16)).sum().item()
        moved += (t.view(torch.int16) != base_sd[name].view(torch.int16)).sum().item()
    assert moved / total > 0.5  # the adapter changed most weights, so equality is not trivial
    assert equal / total >= 0.999, f"only {equal / total:.5f} bitwise equal"
