"""The malformed-input corpus: every case corrupts a copy of a tiny fixture (or names a literal file under
tests/corpus/), runs one ``tuneport`` command on it and states the exact one-line refusal it must produce.

``{base}``, ``{adapter}``, ``{shard}``, ``{gguf}`` and ``{tmp}`` in an expected line stand for the paths of
the case's copies, ``{zoo_base}`` for the tiny base itself, ``{architectures}`` for the supported model types
(see :class:`Work`). tests/test_corpus.py runs them
all under the refusal contract (exit 2, that one line on stderr, no traceback, nothing at the output path, no
temporary left); the HTTP bodies for the gateway are ``HTTP_CASES`` (status 400 and the exact message).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tuneport.convert.arch import ARCHS

HERE = Path(__file__).parent
SHARD = "model-00002-of-00005.safetensors"  # gate_proj, up_proj, o_proj of layer 0
TENSOR = "model.layers.0.mlp.gate_proj.weight"
LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
ST_HINT = "the file is truncated or corrupt: download or copy it again"
CORRUPT = "is not a valid safetensors file"


class Work:
    """One case's workspace: copies of the tiny llama base and its plain adapter, made when first used."""

    def __init__(self, zoo, tmp: Path) -> None:
        self.zoo, self.tmp, self.out = zoo, tmp, tmp / "out"

    @cached_property
    def base(self) -> Path:
        return Path(shutil.copytree(self.zoo.base("llama"), self.tmp / "base"))

    @cached_property
    def adapter(self) -> Path:
        return Path(shutil.copytree(self.zoo.adapter("llama", "plain"), self.tmp / "lora"))

    @property
    def shard(self) -> Path:
        return self.base / SHARD

    @cached_property
    def gguf(self) -> Path:
        return self.tmp / "model.gguf"

    def fields(self) -> dict[str, str]:
        return {"base": str(self.tmp / "base"), "adapter": str(self.tmp / "lora"), "shard": str(self.shard),
                "gguf": str(self.gguf), "tmp": str(self.tmp), "zoo_base": str(self.zoo.base("llama")),
                "architectures": ", ".join(sorted(ARCHS))}

    # -- commands ---------------------------------------------------------------------------------------
    def merge(self) -> tuple:
        base = self.__dict__.get("base") or self.zoo.base("llama")  # the shared fixture when not corrupted
        adapter = self.__dict__.get("adapter") or self.zoo.adapter("llama", "plain")
        return ("merge", "--base", base, "--adapter", adapter, "--out", self.out)

    def export_gguf(self) -> tuple:
        return ("export", "--base", self.base, "--target", "gguf", "--quant", "f32", "--out", self.out)

    def inspect(self, path: Path) -> tuple:
        return ("inspect", path)

    # -- editing ----------------------------------------------------------------------------------------
    def json_edit(self, path: Path, change: Callable[[dict], object]) -> None:
        """Rewrite ``path``'s JSON after ``change`` edited it in place."""
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    def config(self, **changes) -> None:
        self.json_edit(self.base / "config.json", lambda c: c.update(changes))

    def adapter_config(self, **changes) -> None:
        self.json_edit(self.adapter / "adapter_config.json", lambda c: c.update(changes))

    def adapter_tensors(self, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
        f = self.adapter / "adapter_model.safetensors"
        sd = load_file(f)
        change(sd)
        save_file(sd, str(f))


def st_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def st_rewrite(path: Path, change: Callable[[dict], object] | None = None, raw: bytes | None = None) -> None:
    """Write ``path`` again with its header changed (``change`` edits the dict) or replaced by ``raw`` bytes."""
    header, body = st_header(path)
    if raw is None:
        change(header)
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def st_entry(path: Path, name: str, **changes) -> None:
    st_rewrite(path, lambda h: h[name].update(changes))


# -- GGUF: a tiny valid file written field by field, so a case can break exactly one field ----------------
GGUF_STRING, GGUF_UINT32 = 8, 4


def gguf_str(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_file(*, magic: bytes = b"GGUF", version: int = 3, n_tensors: int | None = None, n_kv: int | None = None,
              kv: list[tuple[str, int, bytes]] | None = None, tensors: list[tuple[str, tuple, int, int]] | None = None,
              data: bytes | None = None, truncate: int | None = None) -> bytes:
    """GGUF v3 bytes: ``kv`` as (key, value type, packed value), ``tensors`` as (name, ne, ggml type, offset)."""
    s = gguf_str
    kv = kv if kv is not None else [("general.architecture", GGUF_STRING, s("llama")),
                                    ("general.alignment", GGUF_UINT32, struct.pack("<I", 32))]
    tensors = tensors if tensors is not None else [("token_embd.weight", (4, 8), 0, 0),
                                                   ("output_norm.weight", (4,), 0, 128)]
    out = magic + struct.pack("<I", version)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kv) if n_kv is None else n_kv)
    for key, vtype, value in kv:
        out += s(key) + struct.pack("<I", vtype) + value
    for name, ne, ggml_type, offset in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % 32)
    out += data if data is not None else b"\0" * 160
    return out[:truncate] if truncate is not None else out


# -- the cases ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable[[Work], tuple]  # corrupts the workspace, returns the command's arguments
    expect: str  # the exact refusal line ({base}, {adapter}, {shard}, {gguf}, {tmp} filled in)
    known_bug: str = ""  # where the fix belongs when today's code does not refuse as ``expect`` says (xfail)

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"


CASES: list[Case] = []


def case(category: str, name: str, expect: str, known_bug: str = ""):
    def add(fn: Callable[[Work], tuple]) -> Callable[[Work], tuple]:
        CASES.append(Case(category, name, fn, expect, known_bug))
        return fn
    return add


def st_line(what: str, path: str = "{shard}") -> str:
    return f"error: {path} {CORRUPT} ({what}): {ST_HINT}"


# safetensors headers and offsets (a base shard, read by merge) ---------------------------------------------
@case("safetensors", "empty-file", st_line("only 0 bytes, no header"))
def _(w):
    w.shard.write_bytes(b"")
    return w.merge()


@case("safetensors", "shorter-than-the-length-field", st_line("only 5 bytes, no header"))
def _(w):
    w.shard.write_bytes(b"\x10\0\0\0\0")
    return w.merge()


@case("safetensors", "header-length-too-big", st_line("header length 3280320 is larger than the file (328032 bytes)"))
def _(w):
    data = bytearray(w.shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 10)
    w.shard.write_bytes(bytes(data))
    return w.merge()


@case("safetensors", "header-length-2^64-1",
      st_line("header length 18446744073709551615 is larger than the file (328032 bytes)"))
def _(w):
    data = bytearray(w.shard.read_bytes())
    data[:8] = b"\xff" * 8
    w.shard.write_bytes(bytes(data))
    return w.merge()


@case("safetensors", "truncated-in-the-data",
      st_line("tensor 'model.layers.0.mlp.up_proj.weight' ends at byte 262496, file has 164016"))
def _(w):
    w.shard.write_bytes(w.shard.read_bytes()[:164016])
    return w.merge()


@case("safetensors", "truncated-in-the-header", st_line("header length 344 is larger than the file (100 bytes)"))
def _(w):
    w.shard.write_bytes(w.shard.read_bytes()[:100])
    return w.merge()


@case("safetensors", "header-not-json",
      st_line("corrupt header JSON: Expecting value: line 1 column 1 (char 0)"))
def _(w):
    st_rewrite(w.shard, raw=b"#garbage" + b" " * 40)
    return w.merge()


@case("safetensors", "header-not-utf8", st_line("corrupt header JSON: 'utf-8' codec can't decode byte 0xff in "
                                                "position 2: invalid start byte"))
def _(w):
    st_rewrite(w.shard, raw=b'{"\xff": 1}')
    return w.merge()


@case("safetensors", "header-is-a-list", st_line("corrupt header JSON: header is not a JSON object"))
def _(w):
    st_rewrite(w.shard, raw=b"[1, 2, 3]")
    return w.merge()


@case("safetensors", "header-nested-too-deep", st_line("corrupt header JSON: nested too deeply"))
def _(w):
    st_rewrite(w.shard, raw=b"[" * 100_000 + b"]" * 100_000)
    return w.merge()


@case("safetensors", "entry-not-an-object", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_rewrite(w.shard, lambda h: h.update({TENSOR: 5}))
    return w.merge()


@case("safetensors", "unknown-dtype", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_entry(w.shard, TENSOR, dtype="F99")
    return w.merge()


@case("safetensors", "wrong-dtype-byte-count", st_line(f"tensor {TENSOR!r} has 131072 bytes for shape [256, 128]"))
def _(w):
    st_entry(w.shard, TENSOR, dtype="F16")  # half the bytes the offsets hold
    return w.merge()


@case("safetensors", "missing-data-offsets", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_rewrite(w.shard, lambda h: h[TENSOR].pop("data_offsets"))
    return w.merge()


@case("safetensors", "three-data-offsets", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_entry(w.shard, TENSOR, data_offsets=[0, 131072, 5])
    return w.merge()


@case("safetensors", "data-offsets-reversed", st_line(f"tensor {TENSOR!r} has -131072 bytes for shape [256, 128]"))
def _(w):
    st_entry(w.shard, TENSOR, data_offsets=[131072, 0])
    return w.merge()


@case("safetensors", "negative-offset", st_line(f"tensor {TENSOR!r} has 131072 bytes for shape [256, 128]"))
def _(w):
    st_entry(w.shard, TENSOR, data_offsets=[-8, 131064])
    return w.merge()


@case("safetensors", "shape-byte-count-mismatch", st_line(f"tensor {TENSOR!r} has 131072 bytes for shape [256, 64]"))
def _(w):
    st_entry(w.shard, TENSOR, shape=[256, 64])
    return w.merge()


@case("safetensors", "shape-not-a-list", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_entry(w.shard, TENSOR, shape="256x128")
    return w.merge()


@case("safetensors", "negative-dimensions", st_line(f"bad entry for tensor {TENSOR!r}"))
def _(w):
    st_entry(w.shard, TENSOR, shape=[-256, -128])  # the byte count matches: only the sign is wrong
    return w.merge()


@case("safetensors", "offsets-past-the-end",
      st_line(f"tensor {TENSOR!r} ends at byte 459131, file has 328059"))
def _(w):
    st_entry(w.shard, TENSOR, data_offsets=[327680, 327680 + 131072])
    return w.merge()


@case("safetensors", "overlapping-offsets",
      st_line("tensors 'model.layers.0.mlp.gate_proj.weight' and 'model.layers.0.mlp.up_proj.weight' overlap"))
def _(w):
    st_entry(w.shard, "model.layers.0.mlp.up_proj.weight", data_offsets=[0, 131072])
    return w.merge()


@case("safetensors", "metadata-not-an-object", st_line("__metadata__ is not a JSON object"))
def _(w):
    st_rewrite(w.shard, lambda h: h.update({"__metadata__": ["pt"]}))
    return w.merge()


@case("safetensors", "adapter-file-truncated",
      st_line(f"tensor {LORA_B!r} ends at byte 9232, file has 6000", "{adapter}/adapter_model.safetensors"))
def _(w):
    f = w.adapter / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:6000])
    return w.merge()


# sharded index (model.safetensors.index.json) ----------------------------------------------------------------
INDEX = "model.safetensors.index.json"


@case("index", "not-json",
      "error: {base}/model.safetensors.index.json is not a valid index (Expecting property name "
      "enclosed in double quotes: line 1 column 3 (char 2)): repair or re-download it")
def _(w):
    (w.base / INDEX).write_text("{ weight_map: ")
    return w.merge()


@case("index", "no-weight-map",
      "error: {base}/model.safetensors.index.json is not a valid index (no weight_map): repair or "
      "re-download it")
def _(w):
    w.json_edit(w.base / INDEX, lambda d: d.pop("weight_map"))
    return w.merge()


@case("index", "is-a-list",
      "error: {base}/model.safetensors.index.json is not a valid index (no weight_map): repair or "
      "re-download it")
def _(w):
    (w.base / INDEX).write_text("[]")
    return w.merge()


@case("index", "weight-map-is-a-list",
      "error: {base}/model.safetensors.index.json is not a valid index (weight_map is not an object): "
      "repair or re-download it")
def _(w):
    w.json_edit(w.base / INDEX, lambda d: d.update(weight_map=["model-00001-of-00005.safetensors"]))
    return w.merge()


@case("index", "shard-value-not-a-string",
      "error: {base}/model.safetensors.index.json is not a valid index "
      "(model.layers.0.mlp.gate_proj.weight is in 2, not a .safetensors file of this directory): "
      "repair or re-download it")
def _(w):
    w.json_edit(w.base / INDEX, lambda d: d["weight_map"].update({TENSOR: 2}))
    return w.merge()


@case("index", "missing-shard",
      "error: {base} lacks shard(s) model-00002-of-00005.safetensors: download the missing shards")
def _(w):
    w.shard.unlink()
    return w.merge()


@case("index", "shard-outside-the-directory",
      "error: {base}/model.safetensors.index.json is not a valid index "
      "(model.layers.0.mlp.gate_proj.weight is in '../lora/adapter_model.safetensors', not a "
      ".safetensors file of this directory): repair or re-download it")
def _(w):
    w.json_edit(w.base / INDEX, lambda d: d["weight_map"].update({TENSOR: "../lora/adapter_model.safetensors"}))
    w.adapter  # noqa: B018 - the file the index points at exists
    return w.merge()


@case("index", "tensor-in-two-shards",
      "error: {base}: tensor model.layers.0.mlp.gate_proj.weight is in both "
      "model-00002-of-00005.safetensors and model-00006-of-00005.safetensors: remove the stray file, "
      "or repair model.safetensors.index.json")
def _(w):
    shutil.copy(w.shard, w.base / "model-00006-of-00005.safetensors")
    w.json_edit(w.base / INDEX, lambda d: d["weight_map"].update({"extra": "model-00006-of-00005.safetensors"}))
    return w.merge()


# config.json ----------------------------------------------------------------------------------------------
@case("config", "missing",
      "error: {base} has no config.json: pass a Hugging Face model directory")
def _(w):
    (w.base / "config.json").unlink()
    return w.merge()


@case("config", "not-json",
      "error: {base}/config.json is not valid JSON (Expecting property name enclosed in double quotes: "
      "line 1 column 24 (char 23)): repair or re-download config.json")
def _(w):
    (w.base / "config.json").write_text('{"model_type": "llama",')
    return w.merge()


@case("config", "is-a-list",
      "error: {base}/config.json is not a JSON object: repair or re-download config.json")
def _(w):
    (w.base / "config.json").write_text('["llama"]')
    return w.merge()


@case("config", "no-model-type",
      "error: config.json names no model_type: add the model_type of its architecture (tuneport "
      "supports: {architectures})")
def _(w):
    w.json_edit(w.base / "config.json", lambda c: c.pop("model_type"))
    return w.export_gguf()


@case("config", "unknown-architecture",
      "error: unsupported architecture 'mamba': tuneport supports: {architectures}")
def _(w):
    w.config(model_type="mamba", architectures=["MambaForCausalLM"])
    return w.export_gguf()


@case("config", "model-type-not-a-string",
      "error: {base}/config.json: model_type is ['llama'], not a string: repair or re-download "
      "config.json")
def _(w):
    w.config(model_type=["llama"])
    return w.merge()


@case("config", "heads-not-a-number",
      "error: {base}/config.json: num_attention_heads is 'four', not a positive integer: repair or "
      "re-download config.json")
def _(w):
    w.config(num_attention_heads="four")
    return w.export_gguf()


@case("config", "zero-heads",
      "error: {base}/config.json: num_attention_heads is 0, not a positive integer: repair or "
      "re-download config.json")
def _(w):
    w.config(num_attention_heads=0)
    return w.export_gguf()


@case("config", "heads-do-not-divide-hidden",
      "error: {base}/config.json: hidden_size 128 is not a multiple of num_attention_heads 3: repair "
      "or re-download config.json")
def _(w):
    w.config(num_attention_heads=3, head_dim=None)
    return w.export_gguf()


@case("config", "layers-beyond-the-weights",
      "error: {base}: config.json counts 4 layers but the weights hold no layer 2: download the "
      "missing shards, or repair num_hidden_layers in config.json")
def _(w):
    w.config(num_hidden_layers=4)
    return w.export_gguf()


@case("config", "kv-heads-do-not-divide-heads",
      "error: {base}/config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3: "
      "repair or re-download config.json")
def _(w):
    w.config(num_key_value_heads=3)
    return w.export_gguf()


@case("config", "rope-theta-a-string",
      "error: {base}/config.json: rope_parameters.rope_theta is 'ten thousand', not a number: repair "
      "or re-download config.json")
def _(w):
    w.config(rope_parameters={"rope_theta": "ten thousand", "rope_type": "default"})
    return w.export_gguf()


@case("config", "hidden-size-a-float",
      "error: {base}/config.json: hidden_size is 128.0, not a positive integer: repair or re-download "
      "config.json")
def _(w):
    w.config(hidden_size=128.0)
    return w.merge()


@case("config", "inspect-config-is-a-string",
      "error: {base}/config.json is not a JSON object: repair or re-download config.json")
def _(w):
    (w.base / "config.json").write_text('"llama"')
    return w.inspect(w.base)


# tokenizers (read by the GGUF export) ---------------------------------------------------------------------------
TOKENIZER_HINT = "the model directory needs its tokenizer files"


@case("tokenizer", "tokenizer-json-corrupt",
      "error: cannot load the tokenizer in {base} (JSONDecodeError: Expecting property name enclosed in double "
      "quotes: line 1 column 31 (char 30)): " + TOKENIZER_HINT)
def _(w):
    (w.base / "tokenizer.json").write_text('{"model": {"type": "Unigram", ')
    (w.base / "tokenizer.model").unlink()
    return w.export_gguf()


@case("tokenizer", "tokenizer-model-empty",
      "error: cannot load the tokenizer in {base} (RuntimeError: INTERNAL: unk is not defined.): " + TOKENIZER_HINT)
def _(w):
    (w.base / "tokenizer.model").write_bytes(b"")
    (w.base / "tokenizer.json").unlink()
    return w.export_gguf()


@case("tokenizer", "both-missing", "error: {base} has neither tokenizer.model nor tokenizer.json: add the "
      "tokenizer files")
def _(w):
    (w.base / "tokenizer.model").unlink()
    (w.base / "tokenizer.json").unlink()
    return w.export_gguf()


@case("tokenizer", "tokenizer-config-corrupt",
      "error: cannot load the tokenizer in {base} (JSONDecodeError: Expecting property name enclosed in double "
      "quotes: line 1 column 2 (char 1)): " + TOKENIZER_HINT)
def _(w):
    (w.base / "tokenizer_config.json").write_text("{,}")
    return w.export_gguf()


@case("tokenizer", "unknown-model-type",
      "error: cannot load the tokenizer in {base} (Exception: invalid type: null, expected a string at line 1 "
      "column 2972): " + TOKENIZER_HINT)
def _(w):
    w.json_edit(w.base / "tokenizer.json", lambda t: t["model"].update(type="WordLevel"))
    (w.base / "tokenizer.model").unlink()
    return w.export_gguf()


@case("tokenizer", "sentencepiece-without-a-byte-piece",
      "error: the SentencePiece tokenizer in {base} has no byte piece for 1 of the 256 bytes (first <0x41>): "
      "llama.cpp falls back to byte pieces for text outside its vocabulary and aborts without them: export --target "
      "mlx or vllm, which run the HF tokenizer")
def _(w):
    def rename(t):
        vocab = t["model"]["vocab"]
        vocab["not-a-byte"] = vocab.pop("<0x41>")
    w.json_edit(w.base / "tokenizer.json", rename)
    (w.base / "tokenizer.model").unlink()
    return w.export_gguf()


@case("tokenizer", "more-tokens-than-embedding-rows",
      "error: the tokenizer has 520 tokens but the model only 512 embedding rows: pass the tokenizer "
      "that belongs to this model (after adding tokens, resize embeddings)")
def _(w):
    def grow(t):
        t["added_tokens"] += [{"id": 512 + i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True} for i in range(8)]
    w.json_edit(w.base / "tokenizer.json", grow)
    (w.base / "tokenizer.model").unlink()
    return w.export_gguf()


# adapter_config.json (read by merge) ---------------------------------------------------------------------------
@case("adapter-config", "missing",
      "error: {adapter} has no adapter_config.json: pass the directory PEFT's save_pretrained() wrote "
      "(it holds adapter_config.json and the weights)")
def _(w):
    (w.adapter / "adapter_config.json").unlink()
    return w.merge()


@case("adapter-config", "not-json",
      "error: {adapter}/adapter_config.json is not valid JSON (Expecting property name enclosed in "
      "double quotes: line 1 column 2 (char 1)): repair or re-save the adapter")
def _(w):
    (w.adapter / "adapter_config.json").write_text("{'r': 8}")
    return w.merge()


@case("adapter-config", "is-a-list",
      "error: {adapter}/adapter_config.json is not valid JSON (not a JSON object): repair or re-save "
      "the adapter")
def _(w):
    (w.adapter / "adapter_config.json").write_text("[8, 16]")
    return w.merge()


@case("adapter-config", "unknown-peft-type",
      "error: cannot apply adapter {adapter}: peft_type='IA3': only LoRA adapters are supported")
def _(w):
    w.adapter_config(peft_type="IA3")
    return w.merge()


@case("adapter-config", "no-r",
      "error: cannot apply adapter {adapter}: adapter_config.json lacks 'r'")
def _(w):
    w.json_edit(w.adapter / "adapter_config.json", lambda c: c.pop("r"))
    return w.merge()


@case("adapter-config", "no-lora-alpha",
      "error: cannot apply adapter {adapter}: adapter_config.json lacks 'lora_alpha'")
def _(w):
    w.json_edit(w.adapter / "adapter_config.json", lambda c: c.pop("lora_alpha"))
    return w.merge()


@case("adapter-config", "r-zero",
      "error: cannot apply adapter {adapter}: r=0 must be a positive integer")
def _(w):
    w.adapter_config(r=0)
    return w.merge()


@case("adapter-config", "r-negative",
      "error: cannot apply adapter {adapter}: r=-8 must be a positive integer")
def _(w):
    w.adapter_config(r=-8)
    return w.merge()


@case("adapter-config", "r-a-string",
      "error: cannot apply adapter {adapter}: r='eight' must be a positive integer")
def _(w):
    w.adapter_config(r="eight")
    return w.merge()


@case("adapter-config", "r-a-fraction",
      "error: cannot apply adapter {adapter}: r=8.5 must be a positive integer")
def _(w):
    w.adapter_config(r=8.5)
    return w.merge()


@case("adapter-config", "alpha-a-string",
      "error: cannot apply adapter {adapter}: lora_alpha='sixteen' must be a finite number")
def _(w):
    w.adapter_config(lora_alpha="sixteen")
    return w.merge()


@case("adapter-config", "alpha-nan",
      "error: cannot apply adapter {adapter}: lora_alpha=nan must be a finite number")
def _(w):
    (w.adapter / "adapter_config.json").write_text(
        (w.adapter / "adapter_config.json").read_text().replace('"lora_alpha": 16', '"lora_alpha": NaN'))
    return w.merge()


@case("adapter-config", "use-rslora-a-string",
      "error: cannot apply adapter {adapter}: use_rslora='yes' must be true or false")
def _(w):
    w.adapter_config(use_rslora="yes")
    return w.merge()


@case("adapter-config", "target-modules-a-number",
      "error: cannot apply adapter {adapter}: target_modules=7 must be a list of module names or a "
      "regular expression")
def _(w):
    w.adapter_config(target_modules=7)
    return w.merge()


@case("adapter-config", "rank-pattern-a-list",
      "error: cannot apply adapter {adapter}: rank_pattern=['q_proj'] must be an object {{module "
      "pattern: value}}")
def _(w):
    w.adapter_config(rank_pattern=["q_proj"])
    return w.merge()


@case("adapter-config", "rank-pattern-bad-regex",
      "error: cannot apply adapter {adapter}: rank_pattern key 'q_proj(' is not a regular expression "
      "(missing ), unterminated subpattern at position 6)")
def _(w):
    w.adapter_config(rank_pattern={"q_proj(": 4})
    return w.merge()


@case("adapter-config", "alpha-pattern-a-string-value",
      "error: cannot apply adapter {adapter}: alpha_pattern['q_proj']='big' must be a finite number")
def _(w):
    w.adapter_config(alpha_pattern={"q_proj": "big"})
    return w.merge()


@case("adapter-config", "unknown-option",
      "error: cannot apply adapter {adapter}: unknown PEFT option some_future_option={{'x': 1}}; "
      "tuneport does not know how to apply it")
def _(w):
    w.adapter_config(some_future_option={"x": 1})
    return w.merge()


@case("adapter-config", "use-dora-without-magnitudes",
      "error: adapter {adapter} says use_dora but has no lora_magnitude_vector: the adapter file is "
      "incomplete: re-save it")
def _(w):
    w.adapter_config(use_dora=True)
    return w.merge()


@case("adapter-config", "bias-unknown-value",
      "error: cannot apply adapter {adapter}: bias='sometimes' must be 'none', 'all' or 'lora_only'")
def _(w):
    w.adapter_config(bias="sometimes")
    return w.merge()


@case("adapter-config", "layers-to-transform-a-string",
      "error: cannot apply adapter {adapter}: layers_to_transform='0,1' must be a layer index or a "
      "list of them")
def _(w):
    w.adapter_config(layers_to_transform="0,1")
    return w.merge()


# adapter weights (adapter_model.safetensors, read by merge) -------------------------------------------------------
@case("adapter-weights", "no-weights-file",
      "error: {adapter} has no adapter_model.safetensors: pass a complete PEFT adapter directory")
def _(w):
    (w.adapter / "adapter_model.safetensors").unlink()
    return w.merge()


@case("adapter-weights", "missing-lora-b",
      "error: adapter {adapter}: module model.layers.0.self_attn.q_proj lacks lora_B: the adapter file "
      "is incomplete: re-save it")
def _(w):
    w.adapter_tensors(lambda sd: sd.pop(LORA_B))
    return w.merge()


@case("adapter-weights", "missing-lora-a",
      "error: adapter {adapter}: module model.layers.0.self_attn.q_proj lacks lora_A: the adapter file "
      "is incomplete: re-save it")
def _(w):
    w.adapter_tensors(lambda sd: sd.pop(LORA_A))
    return w.merge()


@case("adapter-weights", "rank-mismatch-between-a-and-b",
      "error: adapter {adapter}: model.layers.0.self_attn.q_proj has A rank 8 but B [128, 4]: the "
      "adapter file is corrupt: re-save it")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({LORA_B: torch.zeros(128, 4)}))
    return w.merge()


@case("adapter-weights", "rank-differs-from-config",
      "error: adapter {adapter}: model.layers.0.self_attn.q_proj has rank 4, config says 8: "
      "adapter_config.json does not belong to these weights")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({LORA_A: torch.zeros(4, 128), LORA_B: torch.zeros(128, 4)}))
    return w.merge()


@case("adapter-weights", "wrong-shape-for-the-base",
      "error: adapter lora does not fit this base: model.layers.0.self_attn.q_proj.weight is [128, "
      "128] in the base but [128, 96] in the adapter: the adapter was trained on another model: pass "
      "the base it was trained on (its adapter_config.json names {zoo_base})")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({LORA_A: torch.zeros(8, 96)}))
    return w.merge()


@case("adapter-weights", "one-dimensional-lora-a",
      "error: adapter {adapter}: model.layers.0.self_attn.q_proj.lora_A is float32 [8], not a matrix "
      "of floating-point numbers: the adapter file is corrupt: re-save it")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({LORA_A: torch.zeros(8)}))
    return w.merge()


@case("adapter-weights", "integer-tensors",
      "error: adapter {adapter}: model.layers.0.self_attn.q_proj.lora_A is int32 [8, 128], not a "
      "matrix of floating-point numbers: the adapter file is corrupt: re-save it")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({LORA_A: torch.zeros(8, 128, dtype=torch.int32)}))
    return w.merge()


@case("adapter-weights", "nan",
      "error: adapter {adapter} has NaN or Inf values in "
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight: training diverged: use an "
      "earlier checkpoint or lower the learning rate")
def _(w):
    w.adapter_tensors(lambda sd: sd[LORA_B].__setitem__((0, 0), float("nan")))
    return w.merge()


@case("adapter-weights", "unrecognised-tensor",
      "error: adapter {adapter} has tensors tuneport does not recognise: "
      "['base_model.model.mystery.scale']: only LoRA adapters saved by PEFT are supported")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({"base_model.model.mystery.scale": torch.zeros(2)}))
    return w.merge()


@case("adapter-weights", "no-tensors",
      "error: adapter {adapter} holds no LoRA tensors: pass the directory PEFT's save_pretrained() "
      "wrote after training")
def _(w):
    w.adapter_tensors(lambda sd: sd.clear())
    return w.merge()


@case("adapter-weights", "module-the-base-lacks",
      "error: adapter lora targets model.layers.9.self_attn.q_proj, which the base lacks: the adapter "
      "was trained on another model: pass the base it was trained on")
def _(w):
    w.adapter_tensors(lambda sd: sd.update({k.replace("layers.0.", "layers.9."): sd.pop(k) for k in list(sd)
                                            if "layers.0." in k}))
    return w.merge()


# GGUF files (read by inspect) -------------------------------------------------------------------------------------
def gguf_case(name: str, expect: str, **fields):
    def run(w):
        w.gguf.write_bytes(gguf_file(**fields))
        return w.inspect(w.gguf)
    CASES.append(Case("gguf", name, run, expect))


@case("gguf", "empty-file",
      "error: {gguf} is not a valid GGUF file (the file is empty): re-export or re-download it")
def _(w):
    w.gguf.write_bytes(b"")
    return w.inspect(w.gguf)


gguf_case("bad-magic",
          "error: {gguf} is not a valid GGUF file (it starts with b'GGML', not GGUF): re-export or "
          "re-download it", magic=b"GGML")
gguf_case("version-1",
          "error: {gguf} is not a valid GGUF file (GGUF version 1; llama.cpp reads versions 2 and 3): "
          "re-export or re-download it", version=1)
gguf_case("version-99",
          "error: {gguf} is not a valid GGUF file (GGUF version 99; llama.cpp reads versions 2 and 3): "
          "re-export or re-download it", version=99)
gguf_case("truncated-in-the-header",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 12 bytes): re-export or re-download it", truncate=12)
gguf_case("truncated-in-the-metadata",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 40 bytes): re-export or re-download it", truncate=40)
gguf_case("truncated-in-the-tensor-infos",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 120 bytes): re-export or re-download it", truncate=120)
gguf_case("truncated-in-the-data",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: tensor token_embd.weight's data runs "
          "past its 260 bytes): re-export or re-download it", truncate=260)
gguf_case("tensor-data-past-the-end",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: tensor output_norm.weight's data runs "
          "past its 384 bytes): re-export or re-download it",
          tensors=[("token_embd.weight", (4, 8), 0, 0), ("output_norm.weight", (4,), 0, 1 << 20)])
gguf_case("tensor-offset-unaligned",
          "error: {gguf} is not a valid GGUF file (tensor output_norm.weight's data is not aligned to 32 "
          "bytes): re-export or re-download it",
          tensors=[("token_embd.weight", (4, 8), 0, 0), ("output_norm.weight", (4,), 0, 129)])
# gguf adds offsets in uint64: this one read the file's first bytes as the tensor (and printed numpy's warning)
gguf_case("tensor-offset-wraps-around",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: tensor output_norm.weight's data runs "
          "past its 384 bytes): re-export or re-download it",
          tensors=[("token_embd.weight", (4, 8), 0, 0), ("output_norm.weight", (4,), 0, (1 << 64) - 32)])
gguf_case("tensor-count-huge",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 384 bytes): re-export or re-download it", n_tensors=1 << 62)
gguf_case("kv-count-huge",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 384 bytes): re-export or re-download it", n_kv=1 << 62)
gguf_case("string-length-huge",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 352 bytes): re-export or re-download it",
          kv=[("general.architecture", GGUF_STRING, struct.pack("<Q", 1 << 60) + b"llama")])
# gguf read items past the end as empty arrays: this one hung until its count ran out
gguf_case("array-count-huge",
          "error: {gguf} is not a valid GGUF file (truncated or corrupt: its metadata or tensors run past "
          "its 384 bytes): re-export or re-download it",
          kv=[("general.architecture", GGUF_STRING, gguf_str("llama")), ("tokenizer.ggml.scores", 9,
                                                                        struct.pack("<IQ", 6, 1 << 60))])
gguf_case("unknown-value-type",
          "error: {gguf} is not a valid GGUF file (unknown metadata value type 99): re-export or "
          "re-download it", kv=[("general.architecture", 99, b"llama")])
gguf_case("unknown-ggml-type",
          "error: {gguf} is not a valid GGUF file (unknown tensor type 200): re-export or re-download it",
          tensors=[("token_embd.weight", (4, 8), 200, 0), ("output_norm.weight", (4,), 0, 128)])
gguf_case("too-many-dimensions",
          "error: {gguf} is not a valid GGUF file (tensor token_embd.weight has 9 dimensions; llama.cpp "
          "allows 4): re-export or re-download it",
          tensors=[("token_embd.weight", (4, 8, 1, 1, 1, 1, 1, 1, 1), 0, 0), ("output_norm.weight", (4,), 0, 128)])
gguf_case("duplicate-tensor-name",
          "error: {gguf} is not a valid GGUF file (two tensors named token_embd.weight): re-export or "
          "re-download it",
          tensors=[("token_embd.weight", (4, 8), 0, 0), ("token_embd.weight", (4,), 0, 128)])
gguf_case("alignment-zero",
          "error: {gguf} is not a valid GGUF file (general.alignment is not a power of two): re-export or "
          "re-download it", kv=[("general.architecture", GGUF_STRING, gguf_str("llama")),
                                     ("general.alignment", GGUF_UINT32, struct.pack("<I", 0))])


# paths given on the command line ----------------------------------------------------------------------------------
LONG = "x" * 300  # longer than any file name


@case("paths", "no-such-user-home",
      "error: ~no-such-user/model: there is no such user's home directory: check the path")
def _(w):
    return w.inspect("~no-such-user/model")


@case("paths", "base-name-too-long", f"error: {LONG[:200]} is not a usable path (File name too long): check the path")
def _(w):
    return ("merge", "--base", LONG, "--adapter", w.zoo.adapter("llama", "plain"), "--out", w.out)


@case("paths", "adapter-name-too-long",
      f"error: {LONG[:200]} is not a usable path (File name too long): check the path")
def _(w):
    return ("merge", "--base", w.zoo.base("llama"), "--adapter", LONG, "--out", w.out)


@case("paths", "output-name-leaves-no-room-for-the-temporary",
      f"error: output name {'o' * 40}... is 240 bytes, over the 224 that leave room for the temporary written beside "
      "it: choose a shorter --out")
def _(w):
    w.out = w.tmp / ("o" * 240)
    return w.merge()


@case("paths", "recipe-missing", "error: cannot read the recipe {tmp}/nope.yaml (FileNotFoundError): pass a recipe "
      "YAML file")
def _(w):
    return ("release", w.tmp / "nope.yaml", "--out", w.out)


# recipes (tuneport release; literal files under tests/corpus/recipes/, the expected line first) ---------------------
def recipe_cases() -> None:
    for path in sorted((HERE / "recipes").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# expect: "), path

        def run(w, path=path):
            recipe = w.tmp / path.name
            shutil.copy(path, recipe)
            return ("release", recipe, "--out", w.out)
        CASES.append(Case("recipe", path.stem, run, first.removeprefix("# expect: ")))


recipe_cases()


# HTTP bodies for the OpenAI gateway (an in-process llama.cpp engine over the tiny llama) ------------------------
@dataclass(frozen=True)
class HttpCase:
    name: str
    path: str  # the route posted to
    body: object  # bytes as sent, or a value sent as JSON
    message: str  # the exact error message of the 400 answer

    @property
    def id(self) -> str:
        return f"http/{self.name}"


COMPLETIONS, CHAT, ADAPTERS = "/v1/completions", "/v1/chat/completions", "/v1/adapters"
USER = [{"role": "user", "content": "hi"}]
HTTP_CASES = [
    HttpCase("not-json", COMPLETIONS, b'{"prompt": "hi",',
             "the request body is not valid JSON (Expecting property name enclosed in double quotes at "
             "character 16)"),
    HttpCase("not-utf8", COMPLETIONS, b"\xff\xfe\x00",
             "the request body is not valid JSON (not UTF-8, or nested too deeply)"),
    HttpCase("empty-body", COMPLETIONS, b"", "the request body must be a JSON object"),
    HttpCase("body-a-list", COMPLETIONS, [{"prompt": "hi"}], "the request body must be a JSON object"),
    HttpCase("body-a-string", CHAT, "hi", "the request body must be a JSON object"),
    HttpCase("nested-too-deep", COMPLETIONS, b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
             "the request body is not valid JSON (not UTF-8, or nested too deeply)"),
    HttpCase("prompt-a-number", COMPLETIONS, {"prompt": 5},
             "'prompt' must be a string, a list of token ids (each >= 0), or a list of either"),
    HttpCase("prompt-negative-token", COMPLETIONS, {"prompt": [1, -2]},
             "'prompt' must be a string, a list of token ids (each >= 0), or a list of either"),
    HttpCase("prompt-token-outside-vocab", COMPLETIONS, {"prompt": [1, 99999]},
             "token ids [99999] are outside the vocabulary (0 to 511)"),
    HttpCase("prompt-empty-token-list", COMPLETIONS, {"prompt": []}, "prompt must not be empty"),
    HttpCase("max-tokens-a-string", COMPLETIONS, {"prompt": "hi", "max_tokens": "8"},
             "'max_tokens' must be an integer >= 0"),
    HttpCase("max-tokens-negative", COMPLETIONS, {"prompt": "hi", "max_tokens": -1},
             "'max_tokens' must be an integer >= 0"),
    HttpCase("max-tokens-past-the-context", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6},
             "prompt of 3 tokens + max_tokens 1000000 does not fit the context of 128: shorten the prompt or "
             "lower max_tokens"),
    HttpCase("temperature-a-string", COMPLETIONS, {"prompt": "hi", "temperature": "hot"},
             "'temperature': Input should be a valid number"),
    HttpCase("temperature-infinite", COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}',
             "'temperature': Input should be a finite number"),
    HttpCase("top-p-zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, "'top_p': Input should be greater than 0"),
    HttpCase("stop-a-number-list", COMPLETIONS, {"prompt": "hi", "stop": [1, 2]},
             "'stop' must be a string or a list of strings"),
    HttpCase("stream-a-string", COMPLETIONS, {"prompt": "hi", "stream": "yes"},
             "'stream': Input should be a valid boolean"),
    HttpCase("logprobs-true-on-completions", COMPLETIONS, {"prompt": "hi", "logprobs": True},
             "'logprobs' must be an integer from 0 to 20"),
    HttpCase("unknown-field", COMPLETIONS, {"prompt": "hi", "temprature": 0.5},
             "'temprature' is not a field tuneport knows: serve with --engine vllm for best_of, presence_penalty, "
             "frequency_penalty, logit_bias (see docs/api-compat.md)"),
    HttpCase("model-a-number", COMPLETIONS, {"prompt": "hi", "model": 7}, "'model' must be a string"),
    HttpCase("model-a-path", COMPLETIONS, {"prompt": "hi", "model": "../../etc/passwd"},
             "invalid adapter name '../../etc/passwd': names match [A-Za-z0-9._-]{1,64}"),
    HttpCase("adapters-weight-a-string", COMPLETIONS, {"prompt": "hi", "adapters": {"a": "heavy"}},
             "'adapters.a' must be a finite number, not 'heavy'"),
    HttpCase("adapters-weight-nan-as-a-string", COMPLETIONS, {"prompt": "hi", "adapters": {"a": "nan"}},
             "'adapters.a' must be a finite number, not 'nan'"),  # float("nan") took it: a NaN adapter scale
    HttpCase("messages-a-string", CHAT, {"messages": "hi"}, "'messages': Input should be a valid list"),
    HttpCase("messages-empty", CHAT, {"messages": []},
             "'messages': List should have at least 1 item after validation, not 0"),
    HttpCase("message-without-role", CHAT, {"messages": [{"content": "hi"}]},
             "'messages': message 0 needs a 'role' string"),
    HttpCase("message-content-a-number", CHAT, {"messages": [{"role": "user", "content": 5}]},
             "'messages': message 0's 'content' must be a string or a list of content parts"),
    HttpCase("message-tool-calls-not-objects", CHAT,
             {"messages": [{"role": "assistant", "content": "", "tool_calls": ["f"]}]},
             "'messages': message 0's 'tool_calls' must be a list of objects with a 'function' object"),
    HttpCase("tool-call-arguments-not-json", CHAT,
             {"messages": [{"role": "assistant", "content": "",
                            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
             "a tool call's 'arguments' is not JSON"),
    HttpCase("chat-logprobs-a-number", CHAT, {"messages": USER, "logprobs": 3},
             "'logprobs' must be true or false"),
    HttpCase("top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2},
             "'top_logprobs' needs 'logprobs': true"),
    HttpCase("tools-not-objects", CHAT, {"messages": USER, "tools": ["f"]},
             "'tools': Input should be a valid dictionary"),
    HttpCase("response-format-unknown-type", CHAT, {"messages": USER, "response_format": {"type": "yaml"}},
             "'response_format.type' 'yaml' is not one of text, json_object, json_schema"),
    HttpCase("admin-load-without-path", ADAPTERS, {"name": "x"}, "body needs 'name' and 'path' strings"),
    HttpCase("admin-body-a-list", ADAPTERS, ["x", "/tmp/x"], "the request body must be a JSON object"),
]


def start_gateway(zoo):
    """``tuneport serve`` over the tiny llama on the in-process llama.cpp engine, on a free port."""
    import tuneport

    return tuneport.serve(base=zoo.base("llama"), engine="llamacpp", port=0, n_ctx=128, contexts=1, kv_f32=True)


def post(client, case: HttpCase):
    if isinstance(case.body, bytes):
        return client.post(case.path, content=case.body, headers={"content-type": "application/json"})
    return client.post(case.path, json=case.body)
