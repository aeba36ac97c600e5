"""``manifest.json``: what an export was made from, what it wrote, and how it measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import __version__
from .checkpoint import Checkpoint, checkpoint_sha256
from .hashing import sha256_file

MANIFEST = "manifest.json"


def input_entries(base: Checkpoint, adapters: list) -> list[dict]:
    """Manifest inputs: the base's files and every adapter (``WeightedAdapter``s), with sha256."""
    inputs = [{"role": "base", "path": str(base.spec), "files": checkpoint_sha256(base)}]
    for w in adapters:
        a = w.adapter
        inputs.append({"role": "adapter", "name": a.name, "path": str(a.path), "weight": w.weight,
                       "sha256": sha256_file(a.file) if a.file else None})
    return inputs


def output_entries(root: Path, known: dict[Path, str] | None = None) -> list[dict]:
    """Every file under ``root`` (the manifest excepted) with bytes and sha256."""
    known = {Path(k).resolve(): v for k, v in (known or {}).items()}
    entries = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            entries.append({
                "path": p.relative_to(root).as_posix(),
                "bytes": p.stat().st_size,
                "sha256": known.get(p.resolve()) or sha256_file(p),
            })
    return entries


def write_manifest(
    root: Path,
    target: str,
    inputs: list[dict],
    options: dict,
    *,
    known_hashes: dict[Path, str] | None = None,
    fidelity: dict | None = None,
    extra: dict | None = None,
) -> dict:
    manifest = {
        "tool": "tuneport",
        "version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": target,
        "inputs": inputs,
        "options": options,
        "outputs": output_entries(root, known_hashes),
    }
    if fidelity is not None:
        manifest["fidelity"] = fidelity
    if extra:
        manifest.update(extra)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest
