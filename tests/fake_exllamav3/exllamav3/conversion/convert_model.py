"""A stand-in for exllamav3's converter (the real one runs CUDA kernels) with its command line, its job
directory and resume (-r restores args.json), its progress and error lines. It writes an EXL3 directory in
exllamav3's layout with the reference encoder of tests/test_exl3.py, so tuneport's orchestration (merge,
command, resume, decode check, atomic publish) runs end to end on a CPU machine. TEST_EXL3_FAIL_AFTER=N makes
it fail after N linears, as an interrupted conversion."""

import argparse
import json
import os
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("-i", "--in_dir")
parser.add_argument("-o", "--out_dir")
parser.add_argument("-w", "--work_dir")
parser.add_argument("-b", "--bits", type=float)
parser.add_argument("-hb", "--head_bits", type=int, default=6)
parser.add_argument("-cb", "--codebook", default="mul1")
parser.add_argument("-r", "--resume", action="store_true")


def prepare(args):
    if not args.work_dir:
        return None, None, False, "Must specify --work_dir"
    work = Path(args.work_dir)
    if args.resume:
        if not (work / "args.json").exists():
            return None, None, False, "Cannot resume: no job in work_dir"
        print(" -- Resuming existing job", flush=True)
        in_args = json.loads((work / "args.json").read_text())
        if args.codebook != in_args["codebook"]:  # as exllamav3: the codebook may be overridden on resume, and
            print(f" !! Warning: Overriding codebook from existing job, was: {in_args['codebook']}")  # -cb defaults
            in_args["codebook"] = args.codebook  # to mul1, so a resume must pass it
    else:
        if args.bits is None or not 1 <= args.bits <= 8:
            return None, None, False, "--bits must be between 1 and 8"
        print(" -- Creating new job", flush=True)
        work.mkdir(parents=True, exist_ok=True)
        in_args = {k: getattr(args, k) for k in ("in_dir", "out_dir", "work_dir", "bits", "head_bits", "codebook")}
        (work / "args.json").write_text(json.dumps(in_args))
    done = json.loads((work / "done.json").read_text()) if (work / "done.json").exists() else []
    return in_args, {"done": done}, True, None


def main(in_args, job_state):
    from safetensors import safe_open

    src = Path(in_args["in_dir"])
    names = []
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            names += [n for n in st.keys() if n.endswith("_proj.weight")]
    fail_after = int(os.environ.get("TEST_EXL3_FAIL_AFTER", "0"))
    done = job_state["done"]
    for n, name in enumerate(sorted(names)):
        key = name[: -len(".weight")]
        if key in done:
            continue
        if fail_after and n >= fail_after:
            print(" !! Error: CUDA out of memory (simulated)", flush=True)
            sys.exit(1)
        print(f" -- Quantized: {key}  bpw:  {int(in_args['bits'])}  proxy_err: 0.001  o  g_sc: 1.0  [0.1 s]",
              flush=True)
        done.append(key)
        (Path(in_args["work_dir"]) / "done.json").write_text(json.dumps(done))
    from test_exl3 import write_exl3

    write_exl3(src, Path(in_args["out_dir"]), bits=int(in_args["bits"]), head_bits=in_args["head_bits"],
               codebooks=(in_args["codebook"],))
    print(" -- All done", flush=True)
