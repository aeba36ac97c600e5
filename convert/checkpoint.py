"""A lazy view of a Hugging Face model directory (or hub id): config, tokenizer files, and tensors
read one at a time from (sharded) safetensors.

Pickle checkpoints (``*.bin``, ``*.pt``) are refused unless ``allow_pickle``; then they are loaded
with ``torch.load(weights_only=True)``, one file at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from .arch import ArchSpec, known_arch
from .errors import UserError
from .fused_experts import ExpertRows, fused_views
from .hashing import sha256_file
from .safetensors_file import SafetensorsFile
from .stored.int4 import packed_weight_shape
from .stored.mlx import unpacked_shape  # an MLX LM weight, packed beside its scales
from .stored.mxfp4 import decode as decode_mxfp4
from .tensors import TensorMeta

# Files that travel with a model: everything a tokenizer, a processor or generation needs.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",  # a multimodal model's processor (transformers 5 keeps the image processor's in it)
    "preprocessor_config.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def user_path(spec: str | Path) -> Path:
    """``spec`` as a local path (``~`` expanded); UserError when no file system could hold it."""
    try:
        path = Path(spec).expanduser()
        path.exists()  # a name too long for the file system raises here, not False
    except RuntimeError:  # ~name of no such user
        raise UserError(f"{spec}: there is no such user's home directory", "check the path") from None
    except (OSError, ValueError) as e:  # ENAMETOOLONG, an embedded NUL byte
        raise UserError(f"{str(spec)[:200]} is not a usable path ({getattr(e, 'strerror', None) or e})",
                        "check the path") from None
    return path


def resolve_hub_path(spec: str | Path, patterns: list[str], what: str, revision: str | None = None) -> Path:
    """A local path as is; otherwise a hub id (at ``revision``: a branch, tag or commit) through
    ``huggingface_hub`` (honours HF_HUB_OFFLINE)."""
    path = user_path(spec)
    if path.exists():
        return path
    if not _HUB_ID.match(str(spec)):
        raise UserError(f"{spec} does not exist", f"pass {what} or a Hugging Face hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(spec), allow_patterns=patterns, revision=revision))
    except Exception as e:  # network, auth, offline mode, unknown repo
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = (
            "HF_HUB_OFFLINE is set and the model is not in the local cache: download it first or unset it"
            if offline
            else "check the id, your network and HF_TOKEN, or pass a local directory"
        )
        raise UserError(f"cannot fetch {spec} from the Hugging Face hub ({type(e).__name__})", hint) from e


def resolve_model_path(spec: str | Path, allow_pickle: bool = False, revision: str | None = None) -> Path:
    """A local model directory or file as is; otherwise a hub id, downloaded (weights, config, tokenizer)."""
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    return resolve_hub_path(spec, patterns + (["*.bin", "*.pt"] if allow_pickle else []),
                            "a model directory (or a .gguf file where GGUF is served)", revision)


# config.json keys every architecture reads as counts, and as real numbers (top level; others are the engines')
CONFIG_COUNTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "num_hidden_layers", "vocab_size", "head_dim", "max_position_embeddings")
CONFIG_REALS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")


def check_config(config: dict, path: Path) -> None:
    """Refuse a config.json whose sizes no model can have (a string, zero, heads that do not divide the
    width), before any exporter computes with them."""
    def bad(why: str) -> UserError:
        return UserError(f"{path}: {why}", "repair or re-download config.json")

    for key in CONFIG_COUNTS:
        v = config.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise bad(f"{key} is {v!r}, not a positive integer")
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    for key, v in [*((k, config.get(k)) for k in CONFIG_REALS), ("rope_parameters.rope_theta", rope.get("rope_theta"))]:
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)):
            raise bad(f"{key} is {v!r}, not a number")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and config.get("hidden_size") and not config.get("head_dim") and config["hidden_size"] % heads:
        raise bad(f"hidden_size {config['hidden_size']} is not a multiple of num_attention_heads {heads}")
    if heads and kv and heads % kv:
        raise bad(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")


class Checkpoint:
    """Config + tokenizer files + an index of which file holds which tensor. Nothing is read eagerly."""

    def __init__(self, spec: str | Path, allow_pickle: bool = False) -> None:
        self.spec = str(spec)
        self.path = resolve_model_path(spec, allow_pickle)
        self.allow_pickle = allow_pickle
        if not self.path.is_dir():
            raise UserError(f"{self.path} is not a directory", "pass the model's directory")
        cfg_path = self.path / "config.json"
        if not cfg_path.exists():
            raise UserError(f"{self.path} has no config.json", "pass a Hugging Face model directory")
        try:
            self.config: dict = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise UserError(f"{cfg_path} is not valid JSON ({e})", "repair or re-download config.json") from e
        if not isinstance(self.config, dict):
            raise UserError(f"{cfg_path} is not a JSON object", "repair or re-download config.json")
        self.model_type: str = self.config.get("model_type", "")
        if not isinstance(self.model_type, str):
            raise UserError(f"{cfg_path}: model_type is {self.model_type!r}, not a string",
                            "repair or re-download config.json")
        check_config(self.config, cfg_path)
        tower = getattr(known_arch(self.model_type), "text_tower", None)
        if tower is not None and not isinstance(self.config.get("text_config"), dict):
            # a multimodal type over a flat text config is its text model (what mlx-lm's exports of it say)
            self.model_type = tower.text_model_type
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        self._pickle_cache: tuple[str, dict[str, torch.Tensor]] | None = None
        self._metas: dict[str, TensorMeta] = {}
        self._rows: dict[str, ExpertRows] = {}  # per-expert names served from fused expert tensors
        self._stored: dict[str, str] = {}  # the model's name -> the name stored, where the two differ
        self._companions: dict[str, str] = {}  # tensors only read with another (MXFP4 scales) -> their file
        self.notes: list[str] = []
        self._index_weights()
        self._strip_stored_prefixes()
        self._unfuse_experts()
        self._decode_mxfp4_experts()

    # -- discovery ---------------------------------------------------------------------------
    def _index_weights(self) -> None:
        st = sorted(self.path.glob("*.safetensors"))
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise ValueError("weight_map is not an object")
                for tensor, shard in weight_map.items():
                    if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                        raise ValueError(f"{tensor} is in {shard!r}, not a .safetensors file of this directory")
            except (ValueError, KeyError, TypeError) as e:
                what = "no weight_map" if isinstance(e, KeyError | TypeError) else str(e)
                raise UserError(f"{index} is not a valid index ({what})", "repair or re-download it") from e
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not (self.path / s).exists()]
            if missing:
                raise UserError(f"{self.path} lacks shard(s) {', '.join(missing)}", "download the missing shards")
            st = [self.path / s for s in shard_names]
        if st:
            self.format = "safetensors"
            for f in st:
                sf = SafetensorsFile(f)
                self._files[f.name] = sf
                for name in sorted(sf.tensors, key=sf.offsets.__getitem__):
                    if name in self._where:
                        raise UserError(f"{self.path}: tensor {name} is in both {self._where[name]} and {f.name}",
                                        "remove the stray file, or repair model.safetensors.index.json")
                    self._where[name] = f.name
                    self._metas[name] = sf.tensors[name]
            return
        pickles = sorted(p for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if not pickles:
            raise UserError(f"{self.path} holds no weights (*.safetensors)", "pass a complete model directory")
        if not self.allow_pickle:
            raise UserError(
                f"{self.path} only has pickle weights ({pickles[0].name})",
                "pickle files can run code when loaded; pass --allow-pickle if you trust them "
                "(loaded with torch.load(weights_only=True)), or convert them to safetensors",
            )
        self.format = "pickle"
        for p in pickles:
            for name, t in self._load_pickle(p).items():
                self._where[name] = p.name
                self._metas[name] = TensorMeta(name, t.dtype, tuple(t.shape))

    def _strip_stored_prefixes(self) -> None:
        """A text model saved under its multimodal parent's names (transformers 5 saves Qwen3.5's text model,
        loaded from the hub's multimodal checkpoint, as ``model.language_model.*``): every reader sees the text
        model's own names (``ArchSpec.stored_prefixes``)."""
        prefixes = self.arch.stored_prefixes if self.arch else ()
        if not prefixes or not any(n.startswith(old) for n in self._where for old, _ in prefixes):
            return
        where, metas = {}, {}
        for name, fname in self._where.items():
            new = next((own + name[len(old):] for old, own in prefixes if name.startswith(old)), name)
            if new in where:
                raise UserError(f"{self.path}: tensor {new} is stored twice (as {self._stored.get(new, new)} and "
                                f"{name})", "remove the stray file, or repair model.safetensors.index.json")
            where[new], metas[new] = fname, replace(self._metas[name], name=new)
            if new != name:
                self._stored[new] = name
        self._where, self._metas = where, metas

    def _unfuse_experts(self) -> None:
        """Present fused expert tensors (transformers 5's in-memory layout, saved as is) under the per-expert
        names every exporter reads, each one served from its rows of the fused tensor."""
        views = fused_views(self.arch, {n: m.shape for n, m in self._metas.items()})
        if not views:
            return
        where, metas = {}, {}
        for name, fname in self._where.items():
            if views.get(name) == []:  # read with other tensors (MXFP4 scales with their blocks)
                self._companions[name] = fname
            for new, shape, rows in views.get(name, [(name, self._metas[name].shape, None)]):  # type: ignore[list-item]
                if new in where or (new != name and new in self._where):
                    raise UserError(f"{self.path}: tensor {new} is stored both per expert and fused ({name})",
                                    "remove the stray file, or repair model.safetensors.index.json")
                where[new] = fname
                metas[new] = TensorMeta(new, torch.bfloat16 if rows is not None and rows.scales
                                        else self._metas[name].dtype, shape)
                if rows is not None:
                    self._rows[new] = rows
        self._where, self._metas = where, metas

    def _decode_mxfp4_experts(self) -> None:
        """gpt-oss as released and as Unsloth merges it: the experts in MXFP4, everything else 16-bit. Every MXFP4
        tensor is served decoded (exactly: E2M1 values times powers of two are bfloat16 numbers), so the checkpoint
        reads as the unquantized model it dequantizes to."""
        quant = self.quantization
        if not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" and self._companions):
            return
        if any(n.endswith(("_blocks", "_scales")) for n in self._where):
            return  # MXFP4 tensors outside the experts: left quantized (refused as such)
        self.stored_quantization = self.config.pop("quantization_config")
        self.notes.append("experts stored in MXFP4, read as the bfloat16 values they decode to (exactly)")

    def _load_pickle(self, p: Path) -> dict[str, torch.Tensor]:
        if self._pickle_cache and self._pickle_cache[0] == p.name:
            return self._pickle_cache[1]
        try:
            sd = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise UserError(f"cannot load {p} with weights_only=True ({type(e).__name__})",
                            "the file holds more than tensors; convert it to safetensors") from e
        if not isinstance(sd, dict):
            raise UserError(f"{p} does not hold a state dict", "convert it to safetensors")
        self._pickle_cache = (p.name, sd)
        return sd

    # -- tensors -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Tensor names in storage order (file by file, offset by offset)."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def meta(self, name: str) -> TensorMeta:
        return self._metas[name]

    def weight_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape ``name`` has in the float model: stored, or (4-bit checkpoints) unpacked from its
        quantized tensors. None when the model has no such tensor."""
        if name in self:
            meta = self.meta(name)
            if meta.dtype == torch.uint32 and isinstance(quant := self.config.get("quantization"), dict):
                return unpacked_shape(quant, name.removesuffix(".weight"), meta.shape)
            return meta.shape
        if name.endswith(".weight") and self.quantization:
            return packed_weight_shape(self, name.removesuffix(".weight"))
        return None

    def read(self, name: str) -> torch.Tensor:
        fname = self._where[name]
        rows = self._rows.get(name)
        source = name if rows is None else rows.source
        source = self._stored.get(source, source)
        if rows is not None and rows.strided:
            return self._read_strided(fname, source, rows)
        if rows is not None and rows.expert >= 0:
            if self.format == "safetensors":
                return self._files[fname].read_rows(source, rows.first, self._metas[name].shape)
            return self._load_pickle(self.path / fname)[source][rows.expert, rows.row:rows.row + rows.rows].clone()
        if self.format == "safetensors":
            return self._files[fname].read(source)
        return self._load_pickle(self.path / fname)[source].clone()

    def _read_strided(self, fname: str, source: str, rows: ExpertRows) -> torch.Tensor:
        """One expert's gate, up or down projection (or bias) of a fused [in, out] layout (gpt-oss, Llama 4); MXFP4
        blocks decoded."""
        def expert_slice(file: str, name: str) -> torch.Tensor:
            if self.format == "safetensors":
                shape = self._files[file].tensors[name].shape
                return self._files[file].read_rows(name, rows.expert * math.prod(shape[1:]), tuple(shape[1:]))
            return self._load_pickle(self.path / file)[name][rows.expert]

        t = expert_slice(fname, source)
        kept = slice(rows.row, rows.row + rows.rows * rows.step, rows.step)
        t = (t.T if rows.transposed else t)[kept]
        if rows.scales:  # the scales may lie in another shard than their blocks
            scales = expert_slice(self._companions[rows.scales], self._stored.get(rows.scales, rows.scales))
            t = decode_mxfp4(t, scales[kept], torch.bfloat16)
        return t.contiguous()

    @property
    def weight_files(self) -> list[Path]:
        return [self.path / f for f in dict.fromkeys(self._where.values())]

    def side_files(self) -> list[Path]:
        return [self.path / f for f in SIDE_FILES if (self.path / f).exists()]

    # -- summary -----------------------------------------------------------------------------
    @property
    def arch(self) -> ArchSpec | None:
        return known_arch(self.model_type)

    @property
    def num_parameters(self) -> int:
        return sum(m.numel for m in self._metas.values())

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype that holds most parameters among floating tensors."""
        count: Counter[torch.dtype] = Counter()
        for m in self._metas.values():
            if m.dtype.is_floating_point:
                count[m.dtype] += m.numel
        return count.most_common(1)[0][0] if count else torch.float32

    @property
    def tied_embeddings(self) -> bool:
        tied = self.config.get("tie_word_embeddings", True)
        arch = self.arch
        lm_head = f"{arch.lm_head}.weight" if arch else "lm_head.weight"
        return bool(tied) and lm_head not in self._where

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization_config")


def checkpoint_sha256(ckpt: Checkpoint) -> dict[str, str]:
    """sha256 of each weight file (free for safetensors files whose tensors were all read in order)."""
    out = {}
    for f in ckpt.weight_files:
        sf = ckpt._files.get(f.name)
        out[f.name] = sf.sha256() if sf else sha256_file(f)
    return out
