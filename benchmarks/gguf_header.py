"""Opening a GGUF file's header: tuneport's reader (``convert.gguf.read.open_gguf``, what ``serve``, ``inspect``,
``verify`` and the export's tokenizer check use) against gguf-py's ``GGUFReader`` (what tuneport used before).

Writes a GGUF with a vocabulary of ``--vocab`` tokens (Gemma 3 has 262,144; Llama 3 128,256), its scores and
token types, ``--merges`` BPE merges (gpt-oss has about 446,000) and one small tensor, then opens it in fresh
processes, ``--repeat`` times each, reading the vocabulary and the tensor list.
Run: python benchmarks/gguf_header.py [--vocab 262144] [--merges 446000] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
from _util import machine, run_python, table  # noqa: E402

# benchmarks/gguf.py would shadow the gguf package: drop this folder from the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(_HERE)]

TUNEPORT = """
from tuneport.convert.gguf.read import gguf_field, open_gguf
r = open_gguf({path!r})
EXTRA = {{"tokens": len(gguf_field(r, "tokenizer.ggml.tokens")), "tensors": len(r.tensors)}}
"""
GGUF_PY = """
from gguf import GGUFReader
r = GGUFReader({path!r})
EXTRA = {{"tokens": len(r.fields["tokenizer.ggml.tokens"].contents()), "tensors": len(r.tensors)}}
"""


def write_gguf(path: Path, vocab: int, merges: int) -> None:
    import gguf
    import numpy as np

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzĠ▁éß中"
    tokens = [f"{i}" + "".join(rng.choice(letters) for _ in range(rng.randint(1, 8))) for i in range(vocab)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([float(-i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    if merges:
        w.add_token_merges([f"{tokens[i % vocab]} {tokens[(i * 7) % vocab]}" for i in range(merges)])
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--merges", type=int, default=446000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        path = Path(tmp) / "vocab.gguf"
        write_gguf(path, args.vocab, args.merges)
        runs: dict[str, list[dict]] = {"tuneport open_gguf": [], "gguf-py GGUFReader": []}
        for _ in range(args.repeat):  # interleaved, so drift in the machine's speed hits both alike
            runs["tuneport open_gguf"].append(run_python(TUNEPORT.format(path=str(path))))
            runs["gguf-py GGUFReader"].append(run_python(GGUF_PY.format(path=str(path))))
        base = statistics.median(r["inner_s"] for r in runs["gguf-py GGUFReader"])
        rows = []
        for name, rs in runs.items():
            t = sorted(r["inner_s"] for r in rs)
            assert all(r["tokens"] == args.vocab for r in rs)
            rows.append([name, f"{t[0]:.2f} / {statistics.median(t):.2f} / {t[-1]:.2f}",
                         f"{max(r['peak_rss_mb'] for r in rs):.0f}", f"{statistics.median(t) / base:.3f}x"])
        print(f"machine: {machine()}")
        print(f"GGUF: {args.vocab} tokens, {args.merges} merges, {path.stat().st_size / 2**20:.1f} MiB; "
              f"{args.repeat} fresh processes each")
        print(table(rows, ["reader", "open + read vocab, s (min / median / max)", "peak RSS MiB", "time vs gguf-py"]))


if __name__ == "__main__":
    main()
