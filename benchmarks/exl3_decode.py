"""EXL3 decode on the CPU: how long tuneport's decoder takes to turn one EXL3 linear back into weights
(unpack the trellis, codebook lookup, tile order, both Hadamard rotations, suh/svh), per K and codebook.
Baseline, in the same run: reading the same weight in fp16 from a safetensors file (what the export's decode
check also reads for its reference). The GPU conversion itself needs CUDA (docs/exl3.md).

Run: python benchmarks/exl3_decode.py [--size 4096]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, table  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

from tuneport.convert.exl3.hadamard import reconstruct  # noqa: E402
from tuneport.convert.exl3.trellis import decode, pack, states_from_symbols  # noqa: E402


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="in = out features of the linear")
    args = ap.parse_args()
    n = args.size
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file({"w": torch.randn(n, n).half()}, path)
        baseline = best_of(lambda: load_file(path)["w"].float())
        rows = []
        for k in (2, 4, 6):
            trellis = pack(states_from_symbols(torch.randint(0, 1 << k, (n // 16, n // 16, 256)), k), k)
            suh, svh = torch.randn(n).half(), torch.randn(n).half()
            for codebook in ("mul1", "mcg", "3inst"):
                s = best_of(lambda: reconstruct(decode(trellis, codebook), suh, svh))  # noqa: B023
                rows.append([str(k), codebook, f"{s:.3f}", f"{n * n / s / 1e6:.0f}", f"{baseline:.3f}",
                             f"{s / baseline:.1f}x"])
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print(f"one {n}x{n} linear, best of 3")
    print(table(rows, ["K", "codebook", "decode s", "M weights/s", "fp16 read s (baseline)", "ratio"]))


if __name__ == "__main__":
    main()
