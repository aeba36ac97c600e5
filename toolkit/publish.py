"""Publishing a release directory to the Hugging Face hub: one commit with every file, then a tag.
``dry_run`` lists the exact operations (repo, every file with size, sha256 and LFS or not, the tag)."""

from __future__ import annotations

from pathlib import Path

from tuneport.convert.io import sha256_file

from .recipe import PublishSpec

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".png")
LFS_MIN_BYTES = 10 << 20  # the hub stores files from 10 MB, and binary weights, with LFS
PRIVATE_PARTS = (".reference", "release-state.json")


def upload_plan(out: Path, spec: PublishSpec) -> dict:
    files = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if not p.is_file() or rel.parts[0] in PRIVATE_PARTS:
            continue
        size = p.stat().st_size
        files.append({"path": rel.as_posix(), "bytes": size, "sha256": sha256_file(p),
                      "lfs": p.suffix in LFS_SUFFIXES or size >= LFS_MIN_BYTES})
    return {"repo": spec.repo, "private": spec.private, "tag": spec.tag, "files": files,
            "operations": [f"create_repo {spec.repo} (private={spec.private}, exist_ok)",
                           f"upload_folder: 1 commit, {len(files)} files",
                           *([f"create_tag {spec.tag}"] if spec.tag else [])]}


def publish(out: Path, spec: PublishSpec, dry_run: bool) -> dict:
    plan = upload_plan(out, spec)
    if dry_run:
        return {"dry_run": True, **plan}
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(spec.repo, private=spec.private, exist_ok=True)
    commit = api.upload_folder(repo_id=spec.repo, folder_path=str(out), commit_message=f"tuneport release {out.name}",
                               ignore_patterns=[f"{p}*" for p in PRIVATE_PARTS])
    if spec.tag:
        api.create_tag(spec.repo, tag=spec.tag, revision=getattr(commit, "oid", None))
    return {"dry_run": False, **plan, "commit": getattr(commit, "commit_url", str(commit))}
