"""The streaming writer, the validating reader and the hashes they compute on the way."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file

from tuneport.convert.atomic import atomic_dir
from tuneport.convert.errors import UserError
from tuneport.convert.safetensors_file import SafetensorsFile
from tuneport.convert.shards import ShardedSafetensorsWriter, plan_shards
from tuneport.convert.tensors import TensorMeta


def specs():
    return [TensorMeta(f"t{i}", dt, (3 + i, 5)) for i, dt in
            enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.int64])]


def tensors():
    gen = torch.Generator().manual_seed(0)
    return {s.name: (torch.randn(s.shape, generator=gen) * 10).to(s.dtype) for s in specs()}


def test_writer_roundtrip_shards_index_and_hashes(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, specs(), max_shard_bytes=150)
    ts = tensors()
    for name, t in ts.items():
        w.write(name, t)
    files = w.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(w.shards) > 1 and set(index["weight_map"]) == set(ts)
    loaded = {}
    for f in files:
        if f.suffix == ".safetensors":
            loaded.update(load_file(f))
    for name, t in ts.items():
        assert torch.equal(loaded[name], t)
    for path, digest in w.sha256().items():
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_out_of_order_writes_still_hash_right(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, specs())
    for name, t in reversed(list(tensors().items())):
        w.write(name, t)
    w.close()
    (path, digest), = w.sha256().items()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


def test_reader_reads_and_hashes_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    w = ShardedSafetensorsWriter(tmp_path, specs())
    ts = tensors()
    for name, t in ts.items():
        w.write(name, t)
    w.close()
    f = SafetensorsFile(tmp_path / "model.safetensors")
    for name in f.tensors:
        assert torch.equal(f.read(name), ts[name])
    want = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert f.sha256() == want
    assert SafetensorsFile(tmp_path / "model.safetensors").sha256() == want  # from the cache now


def test_writer_refuses_wrong_shape(tmp_path):
    w = ShardedSafetensorsWriter(tmp_path, specs())
    with pytest.raises(ValueError):
        w.write("t0", torch.zeros(2, 2))


def test_plan_shards_keeps_order_and_limit():
    s = [TensorMeta(f"t{i}", torch.float32, (10,)) for i in range(10)]  # 40 bytes each
    groups = plan_shards(s, 100)
    assert [x.name for g in groups for x in g] == [x.name for x in s]
    assert all(sum(x.nbytes for x in g) <= 100 for g in groups)


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "partial").write_text("x")
        raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_reader_rejects_overlapping_offsets(tmp_path):
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(UserError, match="has 8 bytes for shape"):
        SafetensorsFile(bad)


def test_stale_temporaries_of_a_sibling_output_are_not_ours(tmp_path):
    """Cleaning up after "run" must not touch the temporary of "run-5" (whose name starts the same)."""
    from tuneport.convert.atomic import remove_stale_temporaries

    theirs = tmp_path / ".tuneport-tmp-run-5-99999999-abcdef12"
    ours = tmp_path / ".tuneport-tmp-run-99999999-abcdef12"
    theirs.mkdir()
    ours.mkdir()
    assert remove_stale_temporaries(tmp_path / "run") == [ours]
    assert theirs.exists()


def test_hash_cache_is_read_once_per_process(zoo, tmp_path, monkeypatch):
    """Opening a sharded checkpoint and hashing it reads sha256.json once, not once per shard."""
    from tuneport.convert import hashing
    from tuneport.convert.checkpoint import Checkpoint, checkpoint_sha256

    monkeypatch.setenv("TUNEPORT_CACHE_DIR", str(tmp_path / "cache"))
    reads = []
    real = hashing.HashCache._entries

    def counting(self):
        if self._data is None:
            reads.append(self.path)
        return real(self)

    monkeypatch.setattr(hashing.HashCache, "_entries", counting)
    base = zoo.base("llama")
    assert len(list(base.glob("*.safetensors"))) > 2
    first = checkpoint_sha256(Checkpoint(base))  # computes and records every shard
    again = checkpoint_sha256(Checkpoint(base))  # answered from the cache
    assert first == again and len(reads) == 1
    assert set(json.loads((tmp_path / "cache" / "sha256.json").read_text())) == {
        str(p.resolve()) for p in base.glob("*.safetensors")}
