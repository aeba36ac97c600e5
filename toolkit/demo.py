"""``tuneport demo``: the main job end to end on a built-in tiny model, in a few seconds.

Builds a tiny llama base and two PEFT adapters, merges one (and checks the merged model against PEFT),
exports the other for vLLM as base + adapter, and prints ``inspect`` for each.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

from convert.export_hf import AdapterArg, merge_to_dir
from convert.export_vllm import LAUNCH_SH, export_vllm
from toolkit.inspect import format_report, inspect_path

console = Console()


def run_demo(out: Path, force: bool = True) -> dict:
    import torch

    from toolkit.fidelity import compare_logits, load_hf, load_peft, logits
    from toolkit.tiny import TinyZoo

    out = Path(out)
    if out.exists() and force:
        shutil.rmtree(out)
    zoo = TinyZoo(out / "models")
    console.rule("[bold]1. a tiny base model and two LoRA adapters (made with PEFT)")
    base = zoo.base("llama")
    chat = zoo.adapter("llama", "all_linear")
    style = zoo.adapter("llama", "rslora")
    console.print(f"base     {base}\nadapter  {chat}  (all-linear, r=8)\nadapter  {style}  (rsLoRA, r=16)")

    console.rule("[bold]2. tuneport merge: base + all-linear adapter -> one HF model")
    merged = out / "merged"
    merge_to_dir(base, [AdapterArg(chat)], merged)
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 200, 300, 411]])
    cmp = compare_logits(logits(load_peft(base, chat), ids), logits(load_hf(merged), ids))
    console.print(f"wrote {merged}\nfidelity vs PEFT (fp32): max |Δlogit| = {cmp.max_abs:.2e}, "
                  f"KL = {cmp.kl:.2e}, top-1 agreement = {cmp.top1:.0%}")

    console.rule("[bold]3. tuneport export --target vllm --adapters separate: base + rsLoRA adapter")
    bundle = out / "vllm-bundle"
    manifest = export_vllm(base, [AdapterArg(style, name="style")], bundle, mode="separate")
    console.print(f"wrote {bundle}; serve it with {bundle / LAUNCH_SH}")
    for name, fixes in manifest.get("fixes", {}).items():
        for f in fixes:
            console.print(f"  {name}: fixed: {f}")

    console.rule("[bold]4. tuneport inspect")
    for path in (base, chat, style, merged, bundle / "adapters" / "style"):
        console.print(format_report(inspect_path(str(path))), markup=False, highlight=False, soft_wrap=True)
        console.print()
    return {"base": str(base), "merged": str(merged), "bundle": str(bundle), "fidelity": cmp.as_dict()}
