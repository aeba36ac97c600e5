"""exllamav3's converter, driven from tuneport: what it needs, its exact command line, resuming, progress.

Facts (exllamav3 1.4-1.6): ``convert.py`` is a thin script over ``exllamav3.conversion.convert_model``'s
``parser``, ``prepare`` and ``main`` (no console script; 1.6's ``__main__`` exits 0 after a refusal), so tuneport
runs the same three calls with the installed package. Flags: ``-i`` an unquantized HF directory, ``-o`` output,
``-w`` work directory (its job state and finished tensors), ``-b`` average bits (1..8), ``-hb`` head bits (1..8,
or 16 for fp16), ``-cb mul1|mcg|3inst`` (default mul1; 1.6 adds half-integer bitrates 1.5/2.5/3.5 with mul1,
which its bit allocation uses below 4 bits), ``-r`` resume the job in ``-w`` (settings restored from its
args.json, some overridable by the flags given). It needs a CUDA GPU: its quantizer and packer are CUDA kernels,
compiled at import.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..arch import ARCHS, target_refusal
from ..errors import UserError
from . import CODEBOOKS, HALF_RATES

log = logging.getLogger(__name__)

DEFAULT_BITS = 4.0
DEFAULT_HEAD_BITS = 6
DEFAULT_CODEBOOK = "mul1"  # exllamav3's own default since 1.4
HEAD_BITS = (*range(1, 9), 16)
# model_types among tuneport's architectures that exllamav3 has a model class for (its
# exllamav3/architecture/architectures.py); the others are refused before any work, with the reason. The
# mixtures of experts are quantized one linear per expert (exllamav3's BlockSparseMLP), each decode-checked
# against the checkpoint's expert (read.expert_reference); the router stays fp16.
EXL3_ARCHS = tuple(m for m, a in ARCHS.items() if a.exl3)  # a view of the architecture table


def exl3_refusal(model_type: str) -> str | None:
    """Why exllamav3 cannot convert ``model_type``, or None."""
    return target_refusal(model_type, "exl3")


INSTALL_HINT = ("on an NVIDIA GPU host: pip install exllamav3 (its extension compiles with nvcc at first import), "
                "then run the same export there; or --dry-run to print the plan here")
CONVERTER_SNIPPET = (
    "import sys\n"
    "from exllamav3.conversion.convert_model import parser, prepare, main\n"
    "args = parser.parse_args()\n"
    "in_args, job_state, ok, err = prepare(args)\n"
    "if not ok:\n"
    "    print(' !! Error: ' + str(err), flush=True)\n"
    "    sys.exit(2)\n"
    "main(in_args, job_state)\n"
)
# one line per linear (1.4: "bpw:  4", 1.6: "bpw:  4.00"), then one per module without proxy_err / rmse
QUANTIZED_LINE = re.compile(r"^ -- Quantized: (\S+)\s+bpw:\s*[\d.]+\s+(?:proxy_err|rmse)")
ERROR_LINE = re.compile(r"^ !! Error: (.*)")  # prepare()'s refusals; " !! Warning..." lines are not errors


@dataclass(frozen=True)
class Requirements:
    cuda: bool
    exllamav3: bool

    @property
    def missing(self) -> list[str]:
        return [what for what, ok in (("a CUDA GPU", self.cuda), ("the exllamav3 package", self.exllamav3)) if not ok]


def requirements() -> Requirements:
    """Whether this machine can convert: CUDA visible to torch, exllamav3 installed (found, not imported: its
    import compiles CUDA code)."""
    import torch

    return Requirements(cuda=torch.cuda.is_available(), exllamav3=importlib.util.find_spec("exllamav3") is not None)


def require_converter(found: Requirements | None = None) -> None:
    found = found or requirements()
    if found.missing:
        raise UserError("EXL3 conversion needs a CUDA GPU and the exllamav3 package (its quantizer runs CUDA "
                        f"kernels); this machine lacks {' and '.join(found.missing)}", INSTALL_HINT)


def check_settings(bits: float, head_bits: float, codebook: str) -> None:
    if not 1.0 <= bits <= 8.0:
        raise UserError(f"--bits {bits:g} is outside exllamav3's range", "use an average of 1 to 8 bits per weight "
                        "(e.g. 4.0)")
    if codebook not in CODEBOOKS:
        raise UserError(f"unknown --codebook {codebook!r}", f"use one of {', '.join(CODEBOOKS)}")
    if head_bits not in HEAD_BITS and head_bits not in HALF_RATES:
        raise UserError(f"--head-bits {head_bits:g} is not one exllamav3 writes",
                        "use 1 to 8, 16 for an fp16 head, or 1.5, 2.5, 3.5 with --codebook mul1")
    if head_bits in HALF_RATES and codebook != "mul1":
        raise UserError(f"--head-bits {head_bits:g} needs the mul1 codebook (exllamav3 has half-integer kernels "
                        "for mul1 only)", "use --codebook mul1, or whole head bits")


@dataclass(frozen=True)
class ConverterRun:
    """One invocation of exllamav3's converter."""

    in_dir: Path  # the merged, unquantized HF directory
    out_dir: Path
    work_dir: Path  # exllamav3's job directory (resumable)
    bits: float
    head_bits: float
    codebook: str
    resume: bool = False

    def argv(self, python: str = sys.executable) -> list[str]:
        """The exact command: every setting, plus ``-r`` to resume the job in ``-w``. The settings are given on a
        resume too: they equal the job's own, and ``-cb`` left out would switch a resumed job to the parser's
        default codebook (exllamav3 lets a resume override it)."""
        flags = ["-i", str(self.in_dir), "-o", str(self.out_dir), "-w", str(self.work_dir), "-b", f"{self.bits:g}",
                 "-hb", f"{self.head_bits:g}", "-cb", self.codebook]
        return [python, "-c", CONVERTER_SNIPPET, *flags, *(["-r"] if self.resume else [])]

    def display(self) -> str:
        """The command as a user would type it with a checkout of exllamav3 (same flags, its convert.py)."""
        return " ".join(["python", "convert.py", *self.argv()[3:]])


def job_started(work_dir: Path) -> bool:
    """Whether exllamav3 left a job in ``work_dir`` (its args.json) that ``-r`` can resume."""
    return (work_dir / "args.json").is_file()


def run_converter(run: ConverterRun, total_linears: int,
                  progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Run the converter, streaming its lines to the log and counting quantized linears for ``progress``;
    its output lines. A failure is a UserError naming the converter's own error and how to resume."""
    run.work_dir.mkdir(parents=True, exist_ok=True)
    log.info("running exllamav3's converter: %s", run.display())
    lines: list[str] = []
    done: set[str] = set()
    proc = subprocess.Popen(run.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        log.info("exllamav3: %s", line)
        if (m := QUANTIZED_LINE.match(line)) and m.group(1) not in done:
            done.add(m.group(1))
            if progress:
                progress(min(len(done), total_linears), total_linears, m.group(1))
    rc = proc.wait()
    if rc:
        errors = [m.group(1) for line in lines if (m := ERROR_LINE.match(line))]
        reason = errors[-1] if errors else next((ln for ln in reversed(lines) if ln.strip()), "no output")
        raise UserError(f"exllamav3's converter failed (exit {rc}): {reason.strip()[:300]}",
                        f"fix the cause and run the same export again: it resumes from {run.work_dir}")
    return lines
