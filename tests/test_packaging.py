"""The distribution: one top-level package (``tuneport``), installable from its wheel into a fresh
environment, where ``import tuneport``, ``tuneport --help`` and ``python -m tuneport`` work and the
repository's folder names (``convert``, ``serve``, ``toolkit``) are not importable."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = {"tuneport": "tuneport", "convert": "tuneport/convert", "serve": "tuneport/serve",
           "toolkit": "tuneport/toolkit"}  # folder in the repository -> where it lands in the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (an in-tree build/ could carry stale modules)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in SOURCES:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, cwd=out, capture_output=True)
    (whl,) = out.glob("tuneport-*.whl")
    return whl


def test_wheel_has_one_top_level_package_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"tuneport"}
    missing = [f"{SOURCES[py.relative_to(REPO).parts[0]]}/{'/'.join(py.relative_to(REPO).parts[1:])}"
               for folder in SOURCES for py in (REPO / folder).rglob("*.py")]
    assert not [m for m in missing if m not in names]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tuneport = tuneport.toolkit.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_wheel_installs_into_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the test environment's packages (torch, typer, ...) beside it; its editable tuneport is not activated,
    # because .pth files in a directory added this way are not processed
    (Path(site) / "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    r = run(str(py), "-c", "import tuneport, tuneport.serve.gateway, tuneport.toolkit.cli, tuneport.convert.gguf.read;"
                           "print(tuneport.__file__, tuneport.__version__, callable(tuneport.serve))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(venv)) and r.stdout.split()[2] == "True"
    for argv in ([str(venv / "bin" / "tuneport"), "--help"], [str(py), "-m", "tuneport", "--help"]):
        r = run(*argv)
        assert r.returncode == 0 and "Usage: tuneport" in r.stdout and "export" in r.stdout, r.stderr
    for bare in ("convert", "serve", "toolkit"):
        r = run(str(py), "-c", f"import {bare}")
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (bare, r.stdout, r.stderr)


def test_import_tuneport_is_light():
    """`import tuneport` (and so `tuneport --help`) loads neither torch nor the web stack."""
    code = "import sys, tuneport; print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
