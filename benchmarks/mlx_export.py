"""MLX export benchmark: ``tuneport export --target mlx --adapter A --quant q4`` (merge + quantize,
streamed) against the usual route: the fine-tune merged into an HF directory first, then
``mlx_lm.convert -q`` (which loads the model lazily and quantizes it as a whole); the table shows the
convert alone and merge + convert. The base is a generated TinyLlama-1.1B-shaped llama (bf16, random
weights) with an r=16 all-linear adapter. Each run is a fresh process: wall time and peak RSS.

Run: python benchmarks/mlx_export.py [--workdir DIR] [--layers N] [--quant q4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine, run_python, table  # noqa: E402
from merge import make_adapter, make_base  # noqa: E402

TUNEPORT = """
from tuneport.toolkit.cli import main
rc = main(['export', '--base', {base!r}, '--adapter', {adapter!r}, '--target', 'mlx', '--quant', {quant!r},
           '--out', {out!r}, '--json'])
assert rc == 0
"""
MERGE = """
from tuneport.toolkit.cli import main
assert main(['merge', '--base', {base!r}, '--adapter', {adapter!r}, '--out', {out!r}, '--json']) == 0
"""
MLX_LM = """
from tuneport.convert.mlx.quant import QUANT_TYPES
from mlx_lm.convert import convert
q = QUANT_TYPES[{quant!r}]
convert({merged!r}, {out!r}, quantize=True, q_bits=q.bits, q_mode=q.mode)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/mlx"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--quant", default="q4")
    args = ap.parse_args()
    from tuneport.toolkit.tiny.tokenizers import write_bytelevel_bpe

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    base, adapter = work / "base", work / "adapter"
    info = make_base(base, args.layers)
    write_bytelevel_bpe(base)  # mlx_lm.convert loads a tokenizer
    make_adapter(adapter, info["specs"])
    print(f"machine: {machine()}")
    print(f"base: {info['params'] / 1e9:.2f}B params, {info['bytes'] / 1e9:.2f} GB bf16; r=16 all-linear adapter; "
          f"--quant {args.quant}")
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(work / "cache")}
    merge = run_python(MERGE.format(base=str(base), adapter=str(adapter), out=str(work / "merged")), env)
    theirs = run_python(MLX_LM.format(quant=args.quant, merged=str(work / "merged"), out=str(work / "mlx-lm")), env)
    ours = run_python(TUNEPORT.format(base=str(base), adapter=str(adapter), quant=args.quant,
                                      out=str(work / "tuneport")), env)
    rows = [["tuneport export --target mlx (merge + quantize)", f"{ours['wall_s']:.1f}",
             f"{ours['peak_rss_mb']:.0f}"],
            ["mlx_lm.convert -q of the merged dir (merge not counted)", f"{theirs['wall_s']:.1f}",
             f"{theirs['peak_rss_mb']:.0f}"],
            ["ratio tuneport / mlx-lm", f"{ours['wall_s'] / theirs['wall_s']:.2f}",
             f"{ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}"],
            ["merge first (tuneport merge) + mlx_lm.convert -q: the usual route",
             f"{merge['wall_s'] + theirs['wall_s']:.1f}", f"{max(merge['peak_rss_mb'], theirs['peak_rss_mb']):.0f}"],
            ["ratio tuneport / usual route", f"{ours['wall_s'] / (merge['wall_s'] + theirs['wall_s']):.2f}",
             f"{ours['peak_rss_mb'] / max(merge['peak_rss_mb'], theirs['peak_rss_mb']):.2f}"]]
    print(table(rows, ["run", "wall s", "peak RSS MB"]))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
