"""The merged Hugging Face directory: ``tuneport merge`` and ``export --target safetensors``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .adapter import load_adapter
from .checkpoint import SIDE_FILES, Checkpoint, checkpoint_sha256
from .errors import UserError
from .io import ShardedSafetensorsWriter, atomic_dir, check_output_path, sha256_file
from .manifest import write_manifest
from .merge import MergePlan, WeightedAdapter, merge_one, plan_merge

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, tensor name)
TOKENIZER_FILES = tuple(f for f in SIDE_FILES if f != "generation_config.json")
DEFAULT_SHARD_BYTES = 2 << 30


@dataclass
class AdapterArg:
    """``PATH[:WEIGHT]`` or ``NAME=PATH[:WEIGHT]`` from the command line."""

    path: Path
    weight: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> AdapterArg:
        name = None
        if "=" in text.split(":")[0]:
            name, text = text.split("=", 1)
        weight = 1.0
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                weight = float(tail)
                text = head
            except ValueError:
                pass
        return cls(Path(text).expanduser(), weight, name or None)


@dataclass
class MergeResult:
    out: Path
    plan: MergePlan
    manifest: dict = field(default_factory=dict)


def load_weighted(adapters: list[AdapterArg], allow_pickle: bool = False) -> list[WeightedAdapter]:
    loaded = [WeightedAdapter(load_adapter(a.path, a.name, allow_pickle), a.weight) for a in adapters]
    names = [w.adapter.name for w in loaded]
    if len(set(names)) != len(names):
        raise UserError(f"two adapters share the name {names}", "name them: --adapter NAME=PATH")
    return loaded


def write_merged(plan: MergePlan, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Progress | None = None) -> dict[Path, str]:
    """Stream the merged tensors into ``out`` (an existing, empty directory); return output sha256s."""
    writer = ShardedSafetensorsWriter(out, plan.specs, max_shard_bytes=max_shard_bytes)
    total = sum(s.nbytes for s in plan.specs)
    done = 0
    try:
        for spec in plan.specs:
            writer.write(spec.name, merge_one(plan, spec))
            done += spec.nbytes
            if progress:
                progress(done, total, spec.name)
        writer.close()
    finally:
        writer.stop()
    hashes = writer.sha256()
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


def merge_inputs(plan: MergePlan, extra_adapters: list[WeightedAdapter] = ()) -> list[dict]:
    """Manifest inputs: the base's files and every adapter, with sha256."""
    inputs = [{"role": "base", "path": str(plan.base.spec), "files": checkpoint_sha256(plan.base)}]
    for w in [*plan.adapters, *extra_adapters]:
        a = w.adapter
        inputs.append({"role": "adapter", "name": a.name, "path": str(a.path), "weight": w.weight,
                       "sha256": sha256_file(a.file) if a.file else None})
    return inputs


def merge_to_dir(
    base: str | Path,
    adapters: list[AdapterArg],
    out: Path,
    dtype: str = "auto",
    force: bool = False,
    allow_pickle: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Progress | None = None,
    target: str = "merge",
) -> MergeResult:
    """Merge ``adapters`` into ``base`` and write a complete HF directory at ``out``, atomically."""
    out = Path(out)
    check_output_path(out, force)
    ckpt = Checkpoint(base, allow_pickle=allow_pickle)
    plan = plan_merge(ckpt, load_weighted(adapters, allow_pickle), dtype)
    with atomic_dir(out, force=force) as tmp:
        hashes = write_merged(plan, tmp, max_shard_bytes, progress)
        manifest = write_manifest(
            tmp, target, merge_inputs(plan),
            {"dtype": dtype, "max_shard_bytes": max_shard_bytes, "notes": plan.notes,
             "config_updates": plan.config_updates},
            known_hashes={tmp / p.name: h for p, h in hashes.items()},
        )
    return MergeResult(out, plan, manifest)
