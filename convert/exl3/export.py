"""``export --target exl3``: merge (the foundation), run exllamav3's converter on the merged fp16 directory,
decode every quantized layer with tuneport's own decoder and check it against the merged weights, then
publish atomically with the per-layer errors in manifest.json.

The work directory (``--work-dir``, default ``OUT.exl3-work`` beside the output) holds the merged input and
exllamav3's job; a failed or interrupted run is resumed from it by running the same export again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..arch import arch_for
from ..atomic import atomic_dir, check_output_path
from ..checkpoint import Checkpoint
from ..errors import FidelityError, UserError
from ..hashing import content_digest
from ..inputs import Progress, open_inputs
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


MISMATCH = 0.9  # relative error past which a layer is not the merged weight at all (a wrong layout or codebook
# gives about 1.4); quantization stays far below it even at 1 bit


def expected_error(bits: float) -> float:
    """The relative error ||decoded - merged|| / ||merged|| a K-bit layer is expected to stay under: 4 * 2^-K,
    about 1.5x what exllamav3's trellis reaches on Gaussian weights (measured with the reference encoder:
    0.26, 0.13, 0.067 at K = 2, 3, 4). Past it a layer is reported (exllamav3 minimizes output error, not weight
    error, so a real conversion may land above); past ``MISMATCH`` the export fails."""
    return 4.0 * 2.0 ** -bits


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


def plan_key(ckpt: Checkpoint, loaded: list, dtype: str, bits: float, head_bits: float, codebook: str) -> dict:
    """What the work directory was made from: the base's files (path, size, mtime), each adapter's content and
    weight, and the settings. Another export, or an input changed since, starts over."""
    base = {str(f.resolve()): [f.stat().st_size, f.stat().st_mtime_ns] for f in ckpt.weight_files}
    adapters = [[w.adapter.name, str(Path(w.adapter.path).resolve()), content_digest(Path(w.adapter.path)),
                 w.weight] for w in loaded]
    return {"base": base, "adapters": adapters, "dtype": dtype, "bits": bits, "head_bits": head_bits,
            "codebook": codebook}


def merged_dtype(opts: ExportOptions) -> str:
    return opts.dtype  # auto keeps the base's dtype: exllamav3 reads fp16, bf16 and fp32 sources


def work_state(work: Path, key: dict) -> tuple[bool, bool, bool]:
    """(made for this export, merged input there, converter job started) of ``work``."""
    try:
        same = json.loads((work / PLAN_FILE).read_text()) == key
    except (OSError, ValueError):
        same = False
    merged = same and (work / MERGED / "manifest.json").is_file()
    return same, merged, merged and job_started(work / JOB)


def prepare_work_dir(work: Path, key: dict, force: bool) -> tuple[bool, bool]:
    """(merged input reusable, converter job resumable) for ``work``. One made for another export (or inputs
    changed since) is cleared, but a started conversion only with ``force``; one tuneport did not make is
    refused."""
    if work.exists() and any(work.iterdir()):
        if not (work / PLAN_FILE).is_file():
            raise UserError(f"--work-dir {work} holds files tuneport did not write",
                            "pass an empty or new directory as --work-dir")
        same, merged, started = work_state(work, key)
        if same:
            return merged, started
        if job_started(work / JOB) and not force:
            raise UserError(f"{work} holds an unfinished conversion made from other inputs or settings",
                            "rerun with the same ones to resume it, pass --force to discard it, or another "
                            "--work-dir")
        log.warning("%s was made from other inputs or settings: starting over", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / PLAN_FILE).write_text(json.dumps(key, indent=1))
    return False, False


def dry_run_plan(opts: ExportOptions, run: ConverterRun, merged_ready: bool) -> list[str]:
    adapters = ", ".join(str(a.path) for a in opts.adapters) or "no adapters"
    return [
        f"merge {adapters} into {opts.base} ({merged_dtype(opts)}): {run.in_dir}"
        + (" (already there: reused)" if merged_ready else ""),
        f"{'resume' if run.resume else 'run'} exllamav3's converter: {run.display()}",
        f"decode every quantized layer on CPU and compare it with the merged weights (fails past {MISMATCH}; "
        "reports layers past 4*2^-K)",
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
    key = plan_key(ckpt, loaded, merged_dtype(opts), bits, head_bits, codebook)
    if opts.dry_run:
        _, merged_ready, started = work_state(work, key)
        run = ConverterRun(work / MERGED, work / CONVERTED, work / JOB, bits, head_bits, codebook, resume=started)
        plan = dry_run_plan(opts, run, merged_ready)
        missing = found.missing
        notes = plan + ([f"this machine lacks {' and '.join(missing)}: run it on a CUDA host"] if missing else [])
        return ExportResult(Path(opts.out), "exl3", {}, notes=notes, details={
            "dry_run": True, "command": run.argv(), "display_command": run.display(), "plan": plan,
            "work_dir": str(work), "resume": run.resume, "requirements": {"cuda": found.cuda,
                                                                         "exllamav3": found.exllamav3}})
    check_output_path(opts.out, opts.force)
    merged_ready, resume = prepare_work_dir(work, key, opts.force)
    if not merged_ready:
        from ..export_hf import merge_to_dir

        merge_to_dir(ExportOptions(base=opts.base, adapters=opts.adapters, target="safetensors", out=work / MERGED,
                                   dtype=merged_dtype(opts), force=True, allow_pickle=opts.allow_pickle), "exl3")
    run = ConverterRun(work / MERGED, work / CONVERTED, work / JOB, bits, head_bits, codebook, resume=resume)
    merged = Checkpoint(work / MERGED)
    run_converter(run, quantized_linear_count(merged), progress)
    report = decode_check(Exl3Model(work / CONVERTED), merged)
    manifest = publish(opts, work / CONVERTED, merged, run, input_entries(ckpt, loaded), report,
                       {"bits": bits, "head_bits": head_bits, "codebook": codebook, "merged_dtype": merged_dtype(opts)})
    shutil.rmtree(work, ignore_errors=True)
    notes = [f"decoded {len(report['layers'])} quantized layers: worst relative error {report['worst']:.4f} "
             f"({report['worst_layer']})"]
    if report["above_expected"]:
        notes.append(f"{len(report['above_expected'])} layers above the expected error for their bits (4*2^-K), "
                     f"e.g. {report['above_expected'][0]}: see decode_check in manifest.json")
    return ExportResult(Path(opts.out), "exl3", manifest, notes=notes, details={"decode_check": report})


def quantized_linear_count(merged: Checkpoint) -> int:
    """The linears exllamav3 quantizes (every 2-D weight but the embedding and a mixture of experts' routers,
    which it keeps fp16; a tied head counts once), for the progress bar."""
    arch = arch_for(merged.model_type)
    router = f".{arch.experts.disk_block}.{arch.experts.router}.weight" if arch.experts else None
    n = sum(1 for name in merged.names() if len(merged.meta(name).shape) == 2 and name != f"{arch.embed}.weight"
            and not (router and name.endswith(router)))
    return n + int(merged.tied_embeddings)


def publish(opts: ExportOptions, converted: Path, merged: Checkpoint, run: ConverterRun, inputs: list[dict],
            report: dict, options: dict) -> dict:
    """The converter's output, TabbyAPI's config and manifest.json at ``opts.out``, atomically. The converter's
    files are linked (copied across file systems), not moved: if publishing fails they are still in the work
    directory, and a rerun publishes them without converting again."""
    with atomic_dir(opts.out, force=opts.force) as tmp:
        for f in sorted(converted.iterdir()):
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
        # TabbyAPI serves it as it is: python main.py --config OUT/tabby-config.yml (in a TabbyAPI checkout)
        write_tabby_config(tmp / CONFIG_NAME, tabby_config(Path(opts.out).absolute(),
                                                          default_max_seq_len(merged.config)))
        manifest = write_manifest(tmp, "exl3", inputs, {**options, "converter": run.display()},
                                  extra={"decode_check": report})
    return manifest


def decode_check(model: Exl3Model, merged: Checkpoint) -> dict:
    """Every quantized layer decoded and compared with the merged weights: FidelityError when one is not that
    weight at all (past ``MISMATCH``); layers above their expected error are listed."""
    arch = arch_for(merged.model_type)
    errors = relative_errors(model, merged, tied_head=f"{arch.embed}.weight")
    layers = {k: {"bits": model.linears[k].bits, "codebook": model.linears[k].codebook,
                  "relative_error": round(e, 6), "expected": round(expected_error(model.linears[k].bits), 6)}
              for k, e in errors.items()}
    if not layers:
        raise FidelityError(f"{model.path} holds no quantized linear to check", "convert the model again")
    worst = max(layers, key=lambda k: layers[k]["relative_error"])
    report = {"layers": layers, "worst_layer": worst, "worst": layers[worst]["relative_error"], "fail_above": MISMATCH,
              "above_expected": [k for k, v in layers.items() if v["relative_error"] > v["expected"]],
              "summary": model.summary()}
    over = {k: v for k, v in layers.items() if v["relative_error"] > MISMATCH}
    if over:
        k, v = next(iter(over.items()))
        raise FidelityError(f"EXL3 layer {k} decodes {v['relative_error']:.3f} away from the merged weights "
                            f"({len(over)} of {len(layers)} layers past {MISMATCH}: not the same weights)",
                            "the converter's output does not match tuneport's decoder: report it with the manifest")
    return report
