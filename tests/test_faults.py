"""Faults while writing: a full disk is exit 2 "no space left" with nothing at the output path; SIGKILL at
random points of a merge, a GGUF export and a cache write leaves nothing or a complete result, and the rerun
succeeds (leaving no temporary behind)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuneport.convert.hashing import sha256_file
from tuneport.toolkit.tiny import make_adapter, make_base


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB filesystem (tmpfs) mounted for the test; skipped where mounting needs privileges we lack."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("command", ["merge", "gguf"])
def test_a_full_disk_is_exit_2_and_leaves_nothing(zoo, cli, small_disk, command):
    out = small_disk / "out"
    args = {"merge": ["merge", "--base", zoo.base("llama"), "--adapter", zoo.adapter("llama", "plain")],
            "gguf": ["export", "--target", "gguf", "--quant", "f16", "--base", zoo.base("llama")]}[command]
    code, _, err = cli(*args, "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: no space left on the device of {small_disk} while writing out: "), err
    assert list(small_disk.iterdir()) == []  # neither the output nor a temporary


def complete(out: Path) -> bool:
    """Whether ``out`` is a whole result: every file its manifest lists is there with its size and sha256."""
    manifest = json.loads((out / "manifest.json").read_text())
    return bool(manifest["outputs"]) and all(
        (out / f["path"]).stat().st_size == f["bytes"] and sha256_file(out / f["path"]) == f["sha256"]
        for f in manifest["outputs"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    base = make_base("llama", root / "base", max_shard_size="4MB",
                     dims=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2))
    return base, make_adapter(base, "all_linear", root / "adapter")


def commands(base: Path, adapter: Path, out: Path, cache: Path) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "tuneport"]
    return {"merge": [*py, "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)],
            "gguf": [*py, "export", "--target", "gguf", "--quant", "f16,q8_0", "--base", str(base),
                     "--adapter", str(adapter), "--out", str(out)],
            "cache": [sys.executable, "-c", "import sys; from pathlib import Path; "
                      "from tuneport.convert.export import cached_export; "
                      f"print(cached_export(Path({str(base)!r}), 'gguf', quant='f16', name='model'))"]}


@pytest.mark.slow
@pytest.mark.parametrize("what", ["merge", "gguf", "cache"])
def test_sigkill_at_random_points_leaves_nothing_or_a_whole_result(inputs, tmp_path, what):
    base, adapter = inputs
    env = {**os.environ, "TUNEPORT_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "out"
    cmd = commands(base, adapter, out, tmp_path / "cache")[what]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    took = time.monotonic() - t0
    def final() -> Path | None:
        if what != "cache":
            return out
        return next((p for p in (tmp_path / "cache" / "gguf").glob("*") if not p.name.startswith(".tuneport-tmp-")),
                    None)

    rng = random.Random(f"kill-{what}")
    for delay in sorted(rng.uniform(0.3 * took, took) for _ in range(3)):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        result = final()
        assert result is None or not result.exists() or complete(result), (what, delay)
        rerun = [*cmd, "--force"] if what != "cache" else cmd  # a whole result is kept unless forced
        done = subprocess.run(rerun, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (what, delay, done.stderr[-1500:])  # the rerun succeeds
        result = final()
        assert result is not None and complete(result), (what, delay)
        parent = result.parent
        assert not [p for p in parent.iterdir() if p.name.startswith(".tuneport-tmp-")], (what, delay)
