"""The merged Hugging Face directory: ``tuneport merge`` and ``export --target safetensors``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from .atomic import atomic_dir
from .checkpoint import SIDE_FILES
from .fused_experts import DiskFuser
from .inputs import Progress, open_inputs
from .load_check import check_hf_dir
from .manifest import input_entries, write_manifest
from .merge import MergePlan, merge_one, plan_merge
from .options import DEFAULT_SHARD_BYTES, ExportOptions, ExportResult, MergeOptions
from .shards import write_tensors

TOKENIZER_FILES = tuple(f for f in SIDE_FILES if f != "generation_config.json")


def write_merged(plan: MergePlan, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Progress | None = None, rename: Callable[[str], str] | None = None) -> dict[Path, str]:
    """Stream the merged tensors into ``out`` (an existing, empty directory), each under ``rename(name)``
    when given; return output sha256s."""
    rename = rename or (lambda name: name)
    fuser = DiskFuser(plan.base.arch, plan.specs)  # gpt-oss: experts written fused, as its checkpoints hold them
    specs = [replace(s, name=rename(s.name)) for s in fuser.specs]
    hashes = write_tensors(out, specs, plan.specs,
                           lambda spec: [(rename(n), t) for n, t in fuser.feed(spec.name, merge_one(plan, spec))],
                           max_shard_bytes=max_shard_bytes, progress=progress)
    (out / "config.json").write_text(json.dumps(plan.config, indent=2))
    copy_side_files(plan, out)
    return hashes


def copy_side_files(plan: MergePlan, out: Path) -> None:
    """Generation config and tokenizer files: the base's, overlaid by the first adapter that ships a
    tokenizer (it was saved after tokens were added, so it matches a resized vocabulary)."""
    for f in plan.base.side_files():
        shutil.copy2(f, out / f.name)
    for w in plan.adapters:
        files = [w.adapter.path / n for n in TOKENIZER_FILES if (w.adapter.path / n).exists()]
        if any(f.name in ("tokenizer.json", "tokenizer_config.json") for f in files):
            for f in files:
                shutil.copy2(f, out / f.name)
            break


def merge_to_dir(opts: MergeOptions, target: str, progress: Progress | None = None) -> ExportResult:
    """Merge ``opts.adapters`` into ``opts.base`` and write a complete HF directory at ``opts.out``, atomically."""
    ckpt, loaded = open_inputs(opts, target)
    plan = plan_merge(ckpt, loaded, opts.dtype)
    with atomic_dir(opts.out, force=opts.force) as tmp:
        hashes = write_merged(plan, tmp, opts.max_shard_bytes, progress)
        load_check = check_hf_dir(tmp)
        manifest = write_manifest(
            tmp, target, input_entries(ckpt, plan.adapters),
            {"dtype": opts.dtype, "max_shard_bytes": opts.max_shard_bytes, "notes": plan.notes,
             "config_updates": plan.config_updates},
            known_hashes={tmp / p.name: h for p, h in hashes.items()}, extra={"load_check": load_check},
        )
    return ExportResult(opts.out, target, manifest, notes=plan.notes,
                        details={"config_updates": plan.config_updates, "load_check": load_check})


def export_safetensors(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """``export --target safetensors``: the merged HF directory."""
    return merge_to_dir(opts, "safetensors", progress)
