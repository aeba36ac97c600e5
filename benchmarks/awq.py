"""AWQ benchmark: ``tuneport export --target awq`` on a generated >= 1B-parameter llama (TinyLlama-1.1B
shape, bf16, random weights), against loading the whole model in transformers (what AutoAWQ and
llm-compressor do before they start). Each run is a fresh process: wall time and peak RSS.

Target: peak RSS <= one block's weights (fp32, as the pass holds them) + calibration activations + 1 GB.
Run: python benchmarks/awq.py [--workdir DIR] [--layers N] [--samples N] [--seqlen N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, run_python, table  # noqa: E402
from merge import make_base  # noqa: E402

TUNEPORT = """
from tuneport.toolkit.cli import main
rc = main(['export', '--base', {base!r}, '--target', 'awq', '--out', {out!r}, '--calib-samples', '{samples}',
           '--calib-seqlen', '{seqlen}', '--json'])
assert rc == 0
"""
WHOLE_MODEL = """
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.bfloat16)
with torch.no_grad():  # one short forward: every weight is read, as any calibration does
    model(torch.arange(16).unsqueeze(0))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/awq"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()
    from tuneport.toolkit.tiny.tokenizers import write_bytelevel_bpe

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    base = work / "base"
    info = make_base(base, args.layers)
    write_bytelevel_bpe(base)  # calibration needs a tokenizer; ids stay inside the 32000-row embedding
    h, inter = 2048, 5632
    block_params = sum(s.numel for s in info["specs"] if s.name.startswith("model.layers.0."))
    block_fp32 = block_params * 4
    acts = args.samples * args.seqlen * h * 4
    target = block_fp32 + acts + (1 << 30)
    print(f"machine: {machine()}")
    print(f"base: {info['params'] / 1e9:.2f}B params, {info['bytes'] / 1e9:.2f} GB bf16; one block "
          f"{block_params / 1e6:.1f}M params ({block_fp32 / 2**20:.0f} MiB fp32); calibration {args.samples} x "
          f"{args.seqlen} tokens ({acts / 2**20:.0f} MiB of fp32 activations, intermediate width {inter})")
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(work / "cache"), "OMP_NUM_THREADS": str(os.cpu_count())}
    whole = run_python(WHOLE_MODEL.format(base=str(base)), env)
    tp = run_python(TUNEPORT.format(base=str(base), out=str(work / "awq"), samples=args.samples,
                                    seqlen=args.seqlen), env)
    out_bytes = sum(f.stat().st_size for f in (work / "awq").glob("*.safetensors"))
    rows = [["transformers: load the whole model (bf16) + one forward", f"{whole['wall_s']:.1f}",
             f"{whole['peak_rss_mb']:.0f}", "1.00"],
            ["tuneport export --target awq (whole job)", f"{tp['wall_s']:.1f}", f"{tp['peak_rss_mb']:.0f}",
             f"{tp['peak_rss_mb'] / whole['peak_rss_mb']:.2f}"]]
    print(table(rows, ["run", "wall s", "peak RSS MiB", "RSS vs whole-model load"]))
    print(f"target peak RSS: {target / 2**20:.0f} MiB (block + activations + 1 GiB): "
          f"{'met' if tp['peak_rss_mb'] * 2**20 <= target else 'NOT met'}; "
          f"output {out_bytes / 1e9:.2f} GB ({info['bytes'] / out_bytes:.1f}x smaller than bf16)")


if __name__ == "__main__":
    main()
