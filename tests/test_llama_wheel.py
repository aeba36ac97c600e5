"""The patched llama-cpp-python: the one the set-up installed is the build of this checkout's patches (its version's
local label is their hash) and has per-sequence LoRA; `tuneport llama-wheel` reuses a cached wheel, reports what it
did in --json, and refuses what it cannot do with one line and exit 2 (nothing cached)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuneport.toolkit import llama_wheel as lw


def test_the_installed_llama_cpp_python_is_this_checkouts_patched_build():
    import llama_cpp

    from tuneport.serve.engines.llamacpp_seq_lora import seq_lora

    assert llama_cpp.__version__ == lw.wheel_version(), "run `make setup`: the patches changed since the last build"
    assert re.fullmatch(r"0\.3\.36\+tuneport\.[0-9a-f]{10}", lw.wheel_version())
    assert seq_lora(llama_cpp) is not None


def test_each_patch_says_what_it_changes_and_why():
    patches = lw.patch_files()
    assert patches and all(p.name[:4].isdigit() for p in patches)
    for p in patches:
        head = p.read_text().split("\ndiff ", 1)[0]
        assert head.startswith(f"tuneport patch {p.name[:4]}:") and "\nWhat:" in head and "\nWhy:" in head, p.name


def test_the_makefile_and_the_command_compute_one_version(tmp_path):
    """The Makefile runs the module as a script before tuneport is installed (stdlib only, toolkit/ off the path)."""
    script = Path(lw.__file__)
    out = subprocess.run([sys.executable, str(script), "--print-version"], capture_output=True, text=True,
                         cwd=tmp_path, check=True)
    assert out.stdout.strip() == lw.wheel_version()


def test_a_cached_wheel_is_reused_and_reported(cli, tmp_path):
    fake = tmp_path / f"llama_cpp_python-{lw.wheel_version()}-py3-none-linux_x86_64.whl"
    fake.write_bytes(b"")
    code, out, err = cli("llama-wheel", "--wheel-dir", tmp_path, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["built"] is False and report["installed"] is False and report["wheel"] == str(fake)
    assert report["patches"] == [p.name for p in lw.patch_files()]


def test_a_missing_patch_program_is_one_line_and_exit_2(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(lw.shutil, "which", lambda name: None)
    code, out, err = cli("llama-wheel", "--wheel-dir", tmp_path / "wheels")
    assert code == 2 and out == ""
    assert err.startswith("error: the `patch` program is needed") and len(err.strip().splitlines()) == 1
    assert not any((tmp_path / "wheels").iterdir())


@pytest.mark.parametrize("stock", [False, True])
def test_stock_and_patched_wheels_never_share_a_name(tmp_path, stock):
    (tmp_path / f"llama_cpp_python-{lw.wheel_version()}-py3-none-linux_x86_64.whl").write_bytes(b"")
    found = lw.cached_wheel(tmp_path, lw.LLAMA_CPP_VERSION if stock else None)
    assert (found is None) if stock else (found is not None)
