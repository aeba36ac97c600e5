"""Merge benchmark: tuneport merge vs PEFT merge_and_unload + save_pretrained vs cp -r.

Generates a checkpoint of realistic shape (default: TinyLlama-1.1B, bf16, 5 shards, random weights)
and an r=16 all-linear adapter, then measures wall time and peak RSS of each in a fresh process.
Run: python benchmarks/merge.py [--workdir DIR] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, run_cmd, run_python, table  # noqa: E402

from tuneport.convert.shards import ShardedSafetensorsWriter  # noqa: E402
from tuneport.convert.tensors import TensorMeta  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_specs(h: int, inter: int, layers: int, heads: int, kv: int, vocab: int) -> list[TensorMeta]:
    d = h // heads
    shapes = {"q_proj": (h, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, h),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    specs = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs.append(TensorMeta(f"{p}.input_layernorm.weight", torch.bfloat16, (h,)))
        for m in LINEARS:
            sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            specs.append(TensorMeta(f"{p}.{sub}.{m}.weight", torch.bfloat16, shapes[m]))
        specs.append(TensorMeta(f"{p}.post_attention_layernorm.weight", torch.bfloat16, (h,)))
    specs += [TensorMeta("model.norm.weight", torch.bfloat16, (h,)),
              TensorMeta("lm_head.weight", torch.bfloat16, (vocab, h))]
    return specs


def make_base(out: Path, layers: int) -> dict:
    h, inter, heads, kv, vocab = 2048, 5632, 32, 4, 32000
    out.mkdir(parents=True)
    specs = llama_specs(h, inter, layers, heads, kv, vocab)
    total = sum(s.nbytes for s in specs)
    writer = ShardedSafetensorsWriter(out, specs, max_shard_bytes=total // 5 + 1)
    gen = torch.Generator().manual_seed(0)
    for s in specs:
        t = torch.randn(s.shape, generator=gen) * (1.0 if s.name.endswith("norm.weight") else 0.02)
        writer.write(s.name, t.to(torch.bfloat16))
    writer.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"params": sum(s.nbytes // 2 for s in specs), "bytes": total, "largest": max(s.nbytes for s in specs),
            "shards": len(writer.shards), "specs": specs}


def make_adapter(out: Path, specs: list[TensorMeta], r: int = 16) -> int:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for s in specs:
        if s.name.split(".")[-2] in LINEARS:
            mod = "base_model.model." + s.name[: -len(".weight")]
            tensors[f"{mod}.lora_A.weight"] = torch.randn((r, s.shape[1]), generator=gen) * 0.01
            tensors[f"{mod}.lora_B.weight"] = torch.randn((s.shape[0], r), generator=gen) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 32, "target_modules": LINEARS, "lora_dropout": 0.0,
           "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(out.parent / "base")}
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return sum(t.numel() * 4 for t in tensors.values())


TUNEPORT = """
from tuneport.toolkit.cli import main
rc = main(['merge', '--base', {base!r}, '--adapter', {adapter!r}, '--out', {out!r}])
assert rc == 0
"""
PEFT = """
import torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
model = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.bfloat16)
model = PeftModel.from_pretrained(model, {adapter!r}).merge_and_unload()
model.save_pretrained({out!r})
"""
IMPORTS = "import torch, tuneport.convert.merge, tuneport.convert.export_hf, tuneport.toolkit.cli\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/merge"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--skip-peft", action="store_true")
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    base, adapter = work / "base", work / "adapter"
    info = make_base(base, args.layers)
    adapter_bytes = make_adapter(adapter, info["specs"])
    print(f"base: {info['params'] / 1e9:.2f}B params, {info['bytes'] / 1e9:.2f} GB bf16 "
          f"in {info['shards']} shards; largest tensor {info['largest'] / 2**20:.0f} MiB; "
          f"adapter {adapter_bytes / 2**20:.0f} MiB (r=16, all-linear)")

    def settle(*paths: Path) -> None:
        """Remove earlier outputs and flush dirty pages, so no run pays for the one before it."""
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        subprocess.run(["sync"], check=True)

    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(work / "cache"), "OMP_NUM_THREADS": str(os.cpu_count())}
    run_cmd(["cp", "-r", str(base), str(work / "warm")])  # warm the page cache, as every run below sees it
    shutil.rmtree(work / "warm")
    cp_runs = []
    for _ in range(2):
        settle(work / "cp")
        cp_runs.append(run_cmd(["cp", "-r", str(base), str(work / "cp")]))
    cp_s = min(cp_runs)
    settle(work / "cp")
    cp_sync_s = run_cmd(f"cp -r {base} {work / 'cp'} && sync", shell=True)
    settle(work / "cp")
    interp = run_python(IMPORTS, env)
    results = {"interpreter": interp}
    tp = TUNEPORT.format(base=str(base), adapter=str(adapter), out=str(work / "tp"))
    settle(work / "tp")
    results["tuneport (first: hashes the base)"] = run_python(tp, env)
    settle(work / "tp")
    results["tuneport (base hash cached)"] = run_python(tp, env)
    if not args.skip_peft:
        settle(work / "peft")
        results["PEFT merge_and_unload + save"] = run_python(PEFT.format(base=str(base), adapter=str(adapter),
                                                                        out=str(work / "peft")), env)

    budget_mb = (2 * info["largest"] + adapter_bytes) / 2**20 + interp["peak_rss_mb"]
    rows = [["cp -r", f"{cp_s:.2f}", "-", "-", "1.00x", "-"],
            ["cp -r && sync", f"{cp_sync_s:.2f}", "-", "-", f"{cp_sync_s / cp_s:.2f}x", "-"]]
    for name, r in results.items():
        if name == "interpreter":
            rows.append(["python + imports only", f"{r['wall_s']:.2f}", "-", f"{r['peak_rss_mb']:.0f}", "-", "-"])
            continue
        rows.append([name, f"{r['wall_s']:.2f}", f"{r['inner_s']:.2f}", f"{r['peak_rss_mb']:.0f}",
                     f"{r['wall_s'] / cp_s:.2f}x", f"{r['peak_rss_mb'] / budget_mb:.2f}"])
    print(f"\nmachine: {machine()}")
    print(f"RSS budget (2x largest tensor + adapter + interpreter) = {budget_mb:.0f} MB\n")
    print(table(rows, ["run", "wall s", "work s (no start-up)", "peak RSS MB", "wall vs cp -r", "RSS / budget"]))
    if not args.skip_peft:
        from safetensors import safe_open

        same = total = 0
        idx = json.loads((work / "tp" / "model.safetensors.index.json").read_text())["weight_map"]
        peft_files = sorted((work / "peft").glob("*.safetensors"))
        handles = [safe_open(str(f), "pt") for f in peft_files]
        where = {k: h for h in handles for k in h.keys()}
        for name, fname in idx.items():
            with safe_open(str(work / "tp" / fname), "pt") as f:
                a = f.get_tensor(name)
            b = where[name].get_tensor(name)
            same += (a.view(torch.int16) == b.view(torch.int16)).sum().item()
            total += a.numel()
        print(f"\ntuneport vs PEFT output: {100 * same / total:.3f}% of elements bitwise equal "
              "(PEFT adds a bf16-rounded delta; tuneport adds in fp32 and rounds once)")


if __name__ == "__main__":
    main()
