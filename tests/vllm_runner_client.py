"""Run jobs in tests/vllm_runner.py (a child process with an in-process vLLM engine) and return its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("vllm_runner.py")
MARKER = "@@VLLM-RESULT@@"


def run_vllm_jobs(jobs: list[dict], tmp: Path) -> list[dict]:
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARKER))
    return json.loads(line[len(MARKER):])
