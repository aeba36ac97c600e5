"""GGUF benchmark: HF -> F16 GGUF with tuneport vs llama.cpp's own convert_hf_to_gguf.py.

Generates a TinyLlama-1.1B-shaped bf16 checkpoint with a SentencePiece tokenizer, converts it with
both tools (each in a fresh process), and compares wall time, peak RSS and every tensor.
llama.cpp's converter comes from the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), unpacked into a
temporary folder (downloaded with pip unless --llama-cpp-src points to an unpacked sdist).
Run: python benchmarks/gguf.py [--workdir DIR] [--layers N] [--llama-cpp-src DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, run_python, table  # noqa: E402
from merge import make_base  # noqa: E402

# this file is named gguf.py: drop its folder from the path so that `import gguf` finds the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

TUNEPORT = """
from tuneport.toolkit.cli import main
rc = main(['export', '--base', {base!r}, '--target', 'gguf', '--quant', 'f16', '--name', 'tp', '--out', {out!r}])
assert rc == 0
"""
LLAMACPP = """
import runpy, sys
sys.path.insert(0, {src!r}); sys.path.insert(0, {src!r} + '/gguf-py')
sys.argv = ['convert_hf_to_gguf.py', {base!r}, '--outtype', 'f16', '--outfile', {out!r}]
runpy.run_path({src!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def llama_cpp_source(tmp: Path, given: Path | None) -> Path:
    if given:
        return given / "vendor" / "llama.cpp" if (given / "vendor").exists() else given
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    "llama-cpp-python==0.3.36", "-d", str(tmp)], check=True)
    sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp, filter="data")
    return next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))


def compare(a: Path, b: Path) -> tuple[int, int, list[str]]:
    import numpy as np
    from gguf import GGUFReader

    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    tb = {t.name: t for t in rb.tensors}
    same, diff = 0, []
    for t in ra.tensors:
        o = tb.get(t.name)
        if o is not None and t.tensor_type == o.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(o.data)):
            same += 1
        else:
            diff.append(t.name)
    return same, len(ra.tensors), diff + [n for n in tb if n not in {t.name for t in ra.tensors}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/gguf"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--llama-cpp-src", type=Path)
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    base = work / "base"
    info = make_base(base, args.layers)
    from tuneport.toolkit.tiny.tokenizers import write_sentencepiece

    write_sentencepiece(base)  # a real SentencePiece tokenizer; the config's 32000 rows are padded
    print(f"base: {info['params'] / 1e9:.2f}B params, {info['bytes'] / 1e9:.2f} GB bf16 in {info['shards']} shards")
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(work / "cache")}
    with tempfile.TemporaryDirectory() as tmp:
        src = llama_cpp_source(Path(tmp), args.llama_cpp_src)
        subprocess.run(["sync"], check=True)
        ref = run_python(LLAMACPP.format(src=str(src), base=str(base), out=str(work / "llamacpp-F16.gguf")), env)
    subprocess.run(["sync"], check=True)
    ours = run_python(TUNEPORT.format(base=str(base), out=str(work / "tp")), env)
    same, total, diff = compare(work / "tp" / "tp-F16.gguf", work / "llamacpp-F16.gguf")
    rows = [["llama.cpp convert_hf_to_gguf.py", f"{ref['wall_s']:.2f}", f"{ref['peak_rss_mb']:.0f}", "1.00x", "1.00x"],
            ["tuneport export --target gguf", f"{ours['wall_s']:.2f}", f"{ours['peak_rss_mb']:.0f}",
             f"{ours['wall_s'] / ref['wall_s']:.2f}x", f"{ours['peak_rss_mb'] / ref['peak_rss_mb']:.2f}x"]]
    print(f"\nmachine: {machine()}\n")
    print(table(rows, ["HF -> F16 GGUF", "wall s", "peak RSS MB", "wall ratio", "RSS ratio"]))
    print(f"\ntensors bitwise equal: {same}/{total}" + (f"; differing: {diff[:5]}" if diff else ""))


if __name__ == "__main__":
    main()
