"""Publishing a release directory to the Hugging Face hub: one commit with every file, then a tag.
``dry_run`` lists the exact operations (repo, every file with size, sha256 and LFS or not, the tag)."""

from __future__ import annotations

from pathlib import Path

from tuneport.convert.errors import UserError
from tuneport.convert.hashing import sha256_file

from .recipe import PublishSpec

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".png")
LFS_MIN_BYTES = 10 << 20  # the hub stores files from 10 MB, and binary weights, with LFS
PRIVATE_PARTS = (".reference", "release-state.json")


def upload_plan(out: Path, spec: PublishSpec) -> dict:
    """What is uploaded: the files the release manifest lists (hashed when it was written), the manifest and
    the model card."""
    import json

    listed = json.loads((out / "manifest.json").read_text())["outputs"]
    extra = [{"path": n, "bytes": (out / n).stat().st_size, "sha256": sha256_file(out / n)}
             for n in ("manifest.json", "README.md")]
    files = [{**f, "lfs": Path(f["path"]).suffix in LFS_SUFFIXES or f["bytes"] >= LFS_MIN_BYTES}
             for f in sorted([*listed, *extra], key=lambda f: f["path"])]
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
    try:
        api.create_repo(spec.repo, private=spec.private, exist_ok=True)
        commit = api.upload_folder(repo_id=spec.repo, folder_path=str(out), allow_patterns=[f["path"] for f in
                                                                                             plan["files"]],
                                   commit_message=f"tuneport release {out.name}")
        if spec.tag:
            api.create_tag(spec.repo, tag=spec.tag, revision=getattr(commit, "oid", None))
    except Exception as e:  # network, auth, an existing tag: the hub's own message
        raise UserError(f"publishing to {spec.repo} failed ({type(e).__name__}: {str(e)[:160]})",
                        "check the token's write access and that the tag is new") from e
    return {"dry_run": False, **plan, "commit": getattr(commit, "commit_url", str(commit))}
