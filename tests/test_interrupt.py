"""SIGKILL during a merge leaves nothing at the final path; the rerun succeeds and cleans up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tuneport.toolkit.tiny import make_adapter, make_base


@pytest.mark.slow  # the default run's budget (4 minutes on 2 cores): runs in the full suite (make test)
def test_sigkill_mid_merge_leaves_nothing(tmp_path):
    base = make_base("llama", tmp_path / "base", max_shard_size="16MB",
                     dims=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4))
    adapter = make_adapter(base, "all_linear", tmp_path / "adapter")
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "tuneport", "merge", "--base", str(base), "--adapter", str(adapter),
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    tmp_glob = f".tuneport-tmp-{out.name}-*"
    while time.time() < deadline and proc.poll() is None:
        tmps = list(tmp_path.glob(tmp_glob))
        if tmps and any(p.suffix == ".safetensors" for p in tmps[0].iterdir()):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "merge finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert list(tmp_path.glob(tmp_glob)), "the killed run's temporary should be there to clean"

    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "config.json").exists() and (out / "manifest.json").exists()
    assert not list(tmp_path.glob(tmp_glob)), "stale temporary not removed"
