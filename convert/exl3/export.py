"""``export --target exl3``: merge (the foundation), run exllamav3's converter on the merged fp16 directory,
decode every quantized layer with tuneport's own decoder and check it against the merged weights, then
publish atomically with the per-layer errors in manifest.json.

The work directory (``--work-dir``, default ``OUT.exl3-work`` beside the output) holds the merged input and
exllamav3's job; a failed or interrupted run is resumed from it by running the same export again.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from ..arch import arch_for
from ..errors import FidelityError, UserError
from ..export import Progress, open_inputs
from ..io import atomic_dir, check_output_path
from ..manifest import input_entries, write_manifest
from ..options import ExportOptions, ExportResult
from .converter import (
    DEFAULT_BITS,
    DEFAULT_CODEBOOK,
    DEFAULT_HEAD_BITS,
    ConverterRun,
    check_settings,
    job_started,
    require_converter,
    requirements,
    run_converter,
)
from .read import Exl3Model, relative_errors
from .tabby import CONFIG_NAME, default_max_seq_len, tabby_config, write_tabby_config

log = logging.getLogger(__name__)
PLAN_FILE = "tuneport-exl3.json"  # in the work directory: what it was made for (a different export starts over)
MERGED, JOB, CONVERTED = "merged", "job", "converted"


def error_bound(bits: float) -> float:
    """The largest relative error ||decoded - merged|| / ||merged|| accepted for a K-bit layer: 1.5 * 2^(1-K)
    (about twice what exllamav3's trellis reaches on Gaussian weights; a wrong layout or codebook gives ~1)."""
    return 1.5 * 2.0 ** (1 - bits)


def settings(opts: ExportOptions) -> tuple[float, float, str]:
    bits = DEFAULT_BITS if opts.bits is None else float(opts.bits)
    head_bits = float(DEFAULT_HEAD_BITS if opts.head_bits is None else opts.head_bits)
    head_bits = int(head_bits) if head_bits.is_integer() else head_bits
    codebook = opts.codebook or DEFAULT_CODEBOOK
    check_settings(bits, head_bits, codebook)
    return bits, head_bits, codebook


def work_dir_for(opts: ExportOptions) -> Path:
    out = Path(opts.out).absolute()
    return Path(opts.work_dir).expanduser().absolute() if opts.work_dir else out.parent / f"{out.name}.exl3-work"


def plan_key(opts: ExportOptions, bits: float, head_bits: float, codebook: str) -> dict:
    return {"base": str(opts.base), "adapters": [asdict(a) | {"path": str(a.path)} for a in opts.adapters],
            "dtype": merged_dtype(opts), "bits": bits, "head_bits": head_bits, "codebook": codebook}


def merged_dtype(opts: ExportOptions) -> str:
    return "fp16" if opts.dtype == "auto" else opts.dtype  # exllamav3 reads fp16/bf16/fp32 sources


def prepare_work_dir(work: Path, key: dict) -> tuple[bool, bool]:
    """(merged input reusable, converter job resumable) for ``work``; a work directory made for other
    settings is cleared, one tuneport did not make is refused."""
    plan = work / PLAN_FILE
    if work.exists() and any(work.iterdir()):
        if not plan.is_file():
            raise UserError(f"--work-dir {work} holds files tuneport did not write",
                            "pass an empty or new directory as --work-dir")
        try:
            same = json.loads(plan.read_text()) == key
        except ValueError:
            same = False
        if same:
            merged = (work / MERGED / "manifest.json").is_file()
            return merged, merged and job_started(work / JOB)
        log.info("%s was made for other settings: starting over", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps(key, indent=1))
    return False, False


def dry_run_plan(opts: ExportOptions, run: ConverterRun, merged_ready: bool) -> list[str]:
    adapters = ", ".join(str(a.path) for a in opts.adapters) or "no adapters"
    return [
        f"merge {adapters} into {opts.base} as {merged_dtype(opts)}: {run.in_dir}"
        + (" (already there: reused)" if merged_ready else ""),
        f"{'resume' if run.resume else 'run'} exllamav3's converter: {run.display()}",
        "decode every quantized layer on CPU and compare it with the merged weights (bound 1.5*2^(1-K))",
        f"publish {Path(opts.out).absolute()} atomically with manifest.json and TabbyAPI's {CONFIG_NAME}; "
        f"remove {run.work_dir.parent}",
    ]


def export_exl3(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    bits, head_bits, codebook = settings(opts)
    found = requirements()
    if not opts.dry_run:
        require_converter(found)  # before any work: the merge alone can take long
    ckpt, loaded = open_inputs(opts, "exl3")
    work = work_dir_for(opts)
    key = plan_key(opts, bits, head_bits, codebook)
    if opts.dry_run:
        same = (work / PLAN_FILE).is_file() and _read_json(work / PLAN_FILE) == key
        merged_ready = same and (work / MERGED / "manifest.json").is_file()
        run = ConverterRun(work / MERGED, work / CONVERTED, work / JOB, bits, head_bits, codebook,
                           resume=merged_ready and job_started(work / JOB))
        plan = dry_run_plan(opts, run, merged_ready)
        missing = found.missing
        notes = plan + ([f"this machine lacks {' and '.join(missing)}: run it on a CUDA host"] if missing else [])
        return ExportResult(Path(opts.out), "exl3", {}, notes=notes, details={
            "dry_run": True, "command": run.argv(), "display_command": run.display(), "plan": plan,
            "work_dir": str(work), "resume": run.resume, "requirements": {"cuda": found.cuda,
                                                                         "exllamav3": found.exllamav3}})
    check_output_path(opts.out, opts.force)
    merged_ready, resume = prepare_work_dir(work, key)
    if not merged_ready:
        from ..export_hf import merge_to_dir

        merge_to_dir(ExportOptions(base=opts.base, adapters=opts.adapters, target="safetensors", out=work / MERGED,
                                   dtype=merged_dtype(opts), force=True, allow_pickle=opts.allow_pickle), "exl3")
    run = ConverterRun(work / MERGED, work / CONVERTED, work / JOB, bits, head_bits, codebook, resume=resume)
    from ..checkpoint import Checkpoint

    merged = Checkpoint(work / MERGED)
    n_linears = sum(1 for n in merged.names() if n.endswith(".weight") and len(merged.meta(n).shape) == 2) - 1
    run_converter(run, max(n_linears, 1), progress)
    report = decode_check(Exl3Model(work / CONVERTED), merged)
    with atomic_dir(opts.out, force=opts.force) as tmp:
        for f in (work / CONVERTED).iterdir():
            shutil.move(str(f), tmp / f.name)
        # TabbyAPI serves it as it is: python main.py --config OUT/tabby-config.yml (in a TabbyAPI checkout)
        write_tabby_config(tmp / CONFIG_NAME, tabby_config(Path(opts.out).absolute(),
                                                          default_max_seq_len(merged.config)))
        manifest = write_manifest(tmp, "exl3", input_entries(ckpt, loaded), {
            "bits": bits, "head_bits": head_bits, "codebook": codebook, "merged_dtype": merged_dtype(opts),
            "converter": run.display()}, extra={"decode_check": report})
    shutil.rmtree(work, ignore_errors=True)
    notes = [f"decoded {len(report['layers'])} quantized layers: worst relative error {report['worst']:.4f} "
             f"({report['worst_layer']})"]
    return ExportResult(Path(opts.out), "exl3", manifest, notes=notes, details={"decode_check": report})


def decode_check(model: Exl3Model, merged) -> dict:
    """Every quantized layer decoded and compared with the merged weights; FidelityError past its bound."""
    arch = arch_for(merged.model_type)
    errors = relative_errors(model, merged, tied_head=f"{arch.embed}.weight")
    layers = {k: {"bits": model.linears[k].bits, "codebook": model.linears[k].codebook,
                  "relative_error": round(e, 6), "bound": error_bound(model.linears[k].bits)}
              for k, e in errors.items()}
    over = {k: v for k, v in layers.items() if v["relative_error"] > v["bound"]}
    worst = max(layers, key=lambda k: layers[k]["relative_error"], default=None)
    report = {"layers": layers, "worst_layer": worst, "worst": layers[worst]["relative_error"] if worst else 0.0,
              "summary": model.summary()}
    if over:
        k, v = next(iter(over.items()))
        raise FidelityError(f"EXL3 layer {k} decodes {v['relative_error']:.3f} away from the merged weights "
                            f"(bound {v['bound']:.3f} for {v['bits']} bits; {len(over)} layers over)",
                            "the converter's output does not match tuneport's decoder: report it with the manifest")
    return report


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
