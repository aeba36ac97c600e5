"""docs/api.md runs as written: every Python example on the page is executed, in order, on the tiny fixtures
(the served one answers completions through the openai client)."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest

import tuneport

pytestmark = pytest.mark.llamacpp
PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_every_example_runs(zoo, tmp_path, monkeypatch):
    shutil.copytree(zoo.base("llama"), tmp_path / "base")
    shutil.copytree(zoo.adapter("llama", "all_linear"), tmp_path / "chat-lora")
    shutil.copytree(zoo.adapter("llama", "rslora"), tmp_path / "style-lora")
    monkeypatch.chdir(tmp_path)
    blocks = examples()
    assert len(blocks) >= 7
    namespace: dict = {}
    printed = io.StringIO()
    for block in blocks:
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(PAGE), "exec"), namespace)  # noqa: S102 - our own documentation
    out = printed.getvalue()
    assert (tmp_path / "merged" / "manifest.json").exists() and (tmp_path / "bundle" / "serve-vllm.sh").exists()
    assert "base-Q8_0.gguf" in out and "adapters/chat-F32.gguf" in out
    assert "--dtype does not apply to --target gguf" in out and not (tmp_path / "never-written").exists()
    assert "gguf-model ['F32', 'Q8_0']" in out
    served = dict(re.findall(r"^(base-Q8_0|chat) ('.*')$", out, flags=re.M))
    assert set(served) == {"base-Q8_0", "chat"} and served["base-Q8_0"] != served["chat"]
    assert "vllm" in out and "vllm.entrypoints.openai.api_server" in out
    assert isinstance(namespace["result"], tuneport.ExportResult)
