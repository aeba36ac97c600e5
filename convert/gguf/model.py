"""HF model -> GGUF, streaming: tensors are read, converted and written one at a time.

Architecture quirks come from the entry's ``GGUFArch`` (``convert.arch``); names from gguf-py's tensor name tables.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..arch import ARCHS, ArchSpec, target_refusal
from ..errors import UserError
from ..experts import expert_groups
from ..split_linears import tensor_parts
from . import linear_attention, mamba2
from .arch_facts import GGUFArch
from .config_keys import GGUFConfigFacts, gguf_config_facts
from .tensor_names import tensor_name_map
from .vocab import GGUFVocab

Progress = Callable[[int, int, str], None]


GGUF_ARCHS: dict[str, GGUFArch] = {m: a.gguf for m, a in ARCHS.items() if a.gguf is not None}  # a table view
KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight")  # norms, and the router (as llama.cpp's converter keeps it)
DROPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


def gguf_refusal(model_type: str) -> str | None:
    """Why the GGUF export refuses ``model_type``, or None."""
    return target_refusal(model_type, "gguf")


def gguf_arch_for(arch: ArchSpec) -> GGUFArch:
    if arch.gguf is None:
        raise UserError(f"GGUF export does not support architecture {arch.model_type!r}",
                        f"supported: {', '.join(sorted(GGUF_ARCHS))}")
    return arch.gguf


def gguf_graph(arch: ArchSpec, config: dict) -> tuple[str, GGUFArch, dict]:
    """(llama.cpp's architecture name, its GGUF facts, the config as they read it) for ``config`` of ``arch``: the
    entry's own, or those of the architecture llama.cpp runs this config as (``GGUFArch.devolve``)."""
    garch = gguf_arch_for(arch)
    if garch.devolve is not None and (devolved := garch.devolve(config)) is not None:
        other, graph_config = devolved
        return ARCHS[other].gguf_arch, gguf_arch_for(ARCHS[other]), graph_config
    return arch.gguf_arch, garch, config


def _cfg(config: dict, keys: Iterable[str]):
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def rope_parameters(config: dict, layer_kind: str = "full_attention") -> dict:
    """RoPE settings (transformers 4 and 5 layouts); per layer kind where the config splits them."""
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        rp = dict(rp.get(layer_kind) or rp.get("full_attention") or {})
    if layer_kind == "sliding_attention" and "rope_local_base_freq" in config and not rp.get("rope_theta"):
        rp = {"rope_theta": config["rope_local_base_freq"]}  # transformers 4's Gemma 3 layout
    rp.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


# The modules whose rows llama.cpp wants in interleaved RoPE pairs, and the config key of their head count.
QK_HEADS = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}


def qk_heads(arch: ArchSpec, config: dict, module: str) -> int | None:
    """Heads to reorder ``module``'s rows by: q/k of llama-family ("normal" RoPE) architectures, else None."""
    key = QK_HEADS.get(module.rsplit(".", 1)[-1])
    if key is None or arch.rope_style != "normal":
        return None
    return int(config.get(key) or config["num_attention_heads"])


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half layout -> llama.cpp interleaved pairs (rows of q/k weights, or of LoRA B)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rp: dict, head_dim: int) -> torch.Tensor:
    base = float(rp["rope_theta"])
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old_ctx = float(rp.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wl = 2 * math.pi / freq
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            s = (old_ctx / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return torch.tensor(out, dtype=torch.float32)


def is_longrope(rp: dict, garch: GGUFArch) -> bool:
    """LongRoPE (transformers' "longrope", formerly "su") on an architecture whose GGUF carries its factors."""
    return garch.longrope and rp["rope_type"] in ("longrope", "su")


def longrope_attention_factor(rp: dict, config: dict, original: int) -> float:
    """The factor LongRoPE scales cos/sin by, as transformers computes it: given, or sqrt(1 + ln(s) / ln(original))
    with s = max_position_embeddings / original (1 when s <= 1)."""
    if rp.get("attention_factor") is not None:
        return float(rp["attention_factor"])
    scale = int(config["max_position_embeddings"]) / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


@dataclass
class TensorPlan:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]
    qtype: str  # GGMLQuantizationType name
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    stack: tuple[str, ...] = ()  # mixture of experts: the per-expert tensors stacked into this one, in order

    @property
    def nbytes(self) -> int:
        import gguf

        q = gguf.GGMLQuantizationType[self.qtype]
        block, type_size = gguf.GGML_QUANT_SIZES[q]
        return math.prod(self.shape) // block * type_size


@dataclass
class GGUFModelPlan:
    arch: ArchSpec
    garch: GGUFArch
    config: dict  # as the GGUF's architecture reads it (``gguf_graph``)
    graph_name: str  # llama.cpp's architecture (general.architecture)
    tensors: list[TensorPlan] = field(default_factory=list)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # generated tensors (rope_freqs)
    facts: GGUFConfigFacts = field(default_factory=GGUFConfigFacts)  # the config audit's decisions


def plan_gguf_model(arch: ArchSpec, config: dict, shapes: list[tuple[str, tuple[int, ...]]],
                    direct_type: str) -> GGUFModelPlan:
    """Name, type and transform of every tensor; ``direct_type`` is F32, F16, BF16, Q8_0 or MXFP4_MOE (llama.cpp's
    MXFP4_MOE: stacked experts MXFP4, as gpt-oss ships them, the other matrices Q8_0)."""

    expert_type = "MXFP4" if direct_type == "MXFP4_MOE" else direct_type
    direct_type = "Q8_0" if direct_type == "MXFP4_MOE" else direct_type

    graph_name, garch, graph_config = gguf_graph(arch, config)
    n_layers = int(config["num_hidden_layers"])
    tmap = tensor_name_map(graph_name, n_layers)
    plan = GGUFModelPlan(arch, garch, graph_config, graph_name,
                         facts=gguf_config_facts(arch.model_type, config))
    tied = config.get("tie_word_embeddings") is True
    stacks = {name: (f"{block}.experts.{proj}" + ("" if proj.endswith(".bias") else ".weight"), order)
              for name, (block, proj, order) in expert_groups(arch, config, [n for n, _ in shapes]).items()}
    for name, shape in shapes:
        if name.endswith(DROPPED_SUFFIXES) or name.startswith(garch.dropped_prefixes):
            continue
        if tied and name == f"{arch.lm_head}.weight":
            continue  # a tied model's stored lm_head is not what transformers computes with
        if (stacked := stacks.get(name)) is not None:  # an expert: the first one writes the stack
            if stacked[1][0] == name:
                gname = tmap.get_name(stacked[0], try_suffixes=(".weight", ".bias"))
                qtype = ("F32" if name.endswith(".bias") else
                         "F16" if expert_type in ("Q8_0", "MXFP4") and shape[-1] % 32 else expert_type)
                plan.tensors.append(TensorPlan(name, gname, (len(stacked[1]), *shape), qtype, None, stacked[1]))
            continue
        if (parts := tensor_parts(arch, config, name)) is not None:  # a fused linear llama.cpp keeps apart
            for part_name, part in parts:
                part_shape = part.shape(tuple(shape))
                qtype = "F32" if len(part_shape) <= 1 else _matrix_type(direct_type, part_shape)
                plan.tensors.append(TensorPlan(name, _gguf_name(tmap, part_name, arch), part_shape, qtype,
                                               part.rows))
            continue
        mapped = (linear_attention.source_name(name) if garch.delta_net else
                  mamba2.source_name(name) if garch.mamba2 else name)
        gname = _gguf_name(tmap, mapped, arch)
        if gname.endswith(garch.weight_suffixed):
            gname += ".weight"  # a bare parameter llama.cpp names as a weight (gpt-oss's attention sinks)
        if len(shape) <= 1 or gname.endswith(KEEP_F32 + garch.keep_f32) or not gname.endswith(".weight"):
            qtype = "F32"
        else:
            qtype = _matrix_type(direct_type, shape)
        transform = None
        module = name.rsplit(".", 1)[0]
        offset = garch.norm_offset if name.endswith("norm.weight") and not name.endswith(
            garch.norm_offset_skip) else 0.0
        scale = (plan.facts.q_norm_factor if module.endswith("q_norm")
                 else plan.facts.q_proj_factor if module.endswith("q_proj") else None)
        if garch.delta_net and (fix := linear_attention.tensor_transform(name, config)) is not None:
            transform = fix  # Gated DeltaNet: llama.cpp's value-head order and parameterization
        elif garch.mamba2 and (fix := mamba2.tensor_transform(name, config)) is not None:
            transform = fix  # Mamba-2: llama.cpp's parameterization and layouts
        elif (heads := qk_heads(arch, config, module)) is not None:
            transform = lambda t, h=heads: permute_qk(t, h)  # noqa: E731
        elif offset or scale:  # Gemma's (w - 1) norms; a query scale folded by the config audit
            transform = lambda t, o=offset, s=scale or 1.0: (t.float() + o) * s  # noqa: E731
        if garch.delta_net:
            shape = linear_attention.gguf_shape(name, tuple(shape))
        elif garch.mamba2:
            shape = mamba2.gguf_shape(name, tuple(shape), config)
        if name.endswith(garch.squeezed):
            shape, transform = (shape[0], *shape[2:]), lambda t: t.squeeze(1)  # noqa: E731
        plan.tensors.append(TensorPlan(name, gname, tuple(shape), qtype, transform))
    rp = rope_parameters(config)
    if garch.rope_freqs is not None:
        plan.extra["rope_freqs.weight"] = factors = garch.rope_freqs(config).float()
        plan.tensors.append(TensorPlan("", "rope_freqs.weight", tuple(factors.shape), "F32"))
    elif rp["rope_type"] == "llama3":
        head_dim = int(config.get("head_dim") or config["hidden_size"] // int(config["num_attention_heads"]))
        plan.extra["rope_freqs.weight"] = llama3_rope_freqs(rp, head_dim)
        plan.tensors.append(TensorPlan("", "rope_freqs.weight", (head_dim // 2,), "F32"))
    elif is_longrope(rp, garch):
        for kind in ("long", "short"):
            factors = torch.tensor(rp[f"{kind}_factor"], dtype=torch.float32)
            plan.extra[f"rope_factors_{kind}.weight"] = factors
            plan.tensors.append(TensorPlan("", f"rope_factors_{kind}.weight", tuple(factors.shape), "F32"))
    elif rp["rope_type"] not in ("default", "linear", "yarn"):
        raise UserError(f"RoPE type {rp['rope_type']!r} is not supported for GGUF export",
                        "supported: default, linear, yarn, llama3")
    return plan


def _matrix_type(direct_type: str, shape: tuple[int, ...]) -> str:
    """A weight matrix's GGUF type: Q8_0 rows need a multiple of 32 columns, else F16 (as llama.cpp's converter)."""
    return "F16" if direct_type == "Q8_0" and shape[-1] % 32 else direct_type


def _gguf_name(tmap, name: str, arch: ArchSpec) -> str:
    gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise UserError(f"tensor {name} has no GGUF name for {arch.model_type}",
                        "the checkpoint has weights this architecture does not define")
    return gname


def write_hparams(writer, plan: GGUFModelPlan, *, n_vocab: int, file_type: int, name: str) -> None:
    cfg, garch = plan.config, plan.garch
    writer.add_type("model")
    writer.add_name(name)
    arch = plan.graph_name
    writer.add_uint32(f"{arch}.block_count", int(cfg["num_hidden_layers"]))
    for suffix, keys, kind in garch.hparams:
        value = _cfg(cfg, keys)
        if suffix == "context_length" and plan.facts.context_length:
            value = plan.facts.context_length
        if value is None:
            continue
        (writer.add_uint32 if kind == "u32" else writer.add_float32)(f"{arch}.{suffix}", value)
    rp = rope_parameters(cfg)
    writer.add_float32(f"{arch}.rope.freq_base", float(rp["rope_theta"]))
    if rp["rope_type"] in ("linear", "yarn") and rp.get("factor"):
        writer.add_string(f"{arch}.rope.scaling.type", rp["rope_type"])
        writer.add_float32(f"{arch}.rope.scaling.factor", float(rp["factor"]))
        if rp["rope_type"] == "yarn" and rp.get("original_max_position_embeddings"):
            writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                              int(rp["original_max_position_embeddings"]))
    if is_longrope(rp, garch):
        # transformers 5 takes a top-level original_max_position_embeddings (Phi-3's layout) over rope_parameters'
        original = int(cfg.get("original_max_position_embeddings") or rp["original_max_position_embeddings"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", longrope_attention_factor(rp, cfg, original))
    for suffix, keys, kind in garch.rope_hparams:
        if (value := _cfg(rp, keys)) is not None:
            (writer.add_uint32 if kind == "u32" else writer.add_float32)(f"{arch}.{suffix}", value)
    if garch.write_freq_base_swa:
        writer.add_float32(f"{arch}.rope.freq_base_swa", float(rope_parameters(cfg, "sliding_attention")["rope_theta"]))
    if garch.write_swa_pattern and cfg.get("layer_types"):
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if garch.sliding_window_default is not None and cfg.get("sliding_window") is None:
        writer.add_uint32(f"{arch}.attention.sliding_window", garch.sliding_window_default)
    if garch.softcap and cfg.get("final_logit_softcapping"):
        writer.add_float32(f"{arch}.final_logit_softcapping", float(cfg["final_logit_softcapping"]))
    if garch.attn_softcap and cfg.get("attn_logit_softcapping"):
        writer.add_float32(f"{arch}.attn_logit_softcapping", float(cfg["attn_logit_softcapping"]))
    if garch.delta_net:
        linear_attention.write_hparams(writer, arch, cfg)
    if garch.mamba2:
        for suffix, value in mamba2.hparams(cfg).items():
            writer.add_uint32(f"{arch}.{suffix}", value)
    for suffix, value in (garch.derived_hparams(cfg) if garch.derived_hparams else {}).items():
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{suffix}", value)
        elif isinstance(value, list):
            writer.add_array(f"{arch}.{suffix}", value)
        else:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{suffix}", value)
    if garch.write_vocab_size:
        writer.add_uint32(f"{arch}.vocab_size", n_vocab)
    if garch.write_rope_dims:
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        partial = float(rope_parameters(cfg).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
        writer.add_uint32(f"{arch}.rope.dimension_count", int(partial * head_dim))
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)


def to_gguf_array(t: torch.Tensor, qtype: str) -> np.ndarray:
    """A tensor as the bytes/values GGUFWriter writes for ``qtype``."""
    import gguf

    if qtype == "F32":
        return t.to(torch.float32).contiguous().numpy()
    if qtype == "F16":
        return t.to(torch.float16).contiguous().numpy()
    if qtype == "BF16":
        return t.to(torch.bfloat16).contiguous().view(torch.uint16).numpy().view(np.uint8)
    return gguf.quants.quantize(t.to(torch.float32).contiguous().numpy(), gguf.GGMLQuantizationType[qtype])


class _HashingFile:
    """A write-only file that feeds every byte to a sha256 as it goes to disk."""

    def __init__(self, f) -> None:
        from ..hashing import OrderedHasher

        self._f = f
        self.hasher = OrderedHasher()

    def write(self, data) -> int:
        data = bytes(data) if not isinstance(data, (bytes, memoryview)) else data
        self.hasher.update(data)
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _hashing_writer(path: Path, arch: str):
    """gguf.GGUFWriter whose output is hashed while written (no second read for the manifest)."""
    import gguf

    class HashingGGUFWriter(gguf.GGUFWriter):
        def open_output_file(self, path: Path | None = None) -> None:
            super().open_output_file(path)
            if self.fout is not None and not isinstance(self.fout[0], _HashingFile):
                self.fout = [_HashingFile(f) for f in self.fout]

        def write_tensor_data(self, tensor: np.ndarray, tensor_endianess=None) -> None:
            fout = self.fout[0]
            name = next(iter(self.tensors[0]))
            ti = self.tensors[0].pop(name)
            assert ti.nbytes == tensor.nbytes
            self.write_padding(fout, fout.tell())
            fout.write(memoryview(np.ascontiguousarray(tensor)).cast("B"))
            self.write_padding(fout, tensor.nbytes)
            self.state = gguf.gguf_writer.WriterState.WEIGHTS

        def sha256(self) -> str:
            return self.fout[0].hasher.hexdigest()

        def _pack_val(self, val, vtype, add_vtype: bool, sub_type=None) -> bytes:
            """gguf-py refuses an empty array; GGUF allows one (its element type given), and llama.cpp needs
            some keys present even when empty (a BPE vocabulary's merges)."""
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            if (vtype == gguf.GGUFValueType.ARRAY and isinstance(val, list) and val
                    and self.endianess == gguf.GGUFEndian.LITTLE):
                # a vocabulary's arrays in one call each (gguf packs item by item: seconds for 200k tokens)
                head = self._pack("I", vtype) if add_vtype else b""
                if sub_type in (None, gguf.GGUFValueType.STRING) and all(isinstance(v, str) for v in val):
                    items = [v.encode() for v in val]
                    return (head + struct.pack("<IQ", gguf.GGUFValueType.STRING, len(items))
                            + b"".join(struct.pack("<Q", len(b)) + b for b in items))
                if fmt := _number_array_format(val, sub_type):
                    return head + struct.pack(f"<IQ{len(val)}{fmt[1]}", fmt[0], len(val), *val)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return HashingGGUFWriter(str(path), arch)


def _number_array_format(val: list, sub_type) -> tuple[int, str] | None:
    """(GGUF item type, struct format) for a list of numbers gguf would pack one at a time (a vocabulary's scores
    and token types), or None."""
    import gguf

    if sub_type is None:
        if all(type(v) is float for v in val):
            sub_type = gguf.GGUFValueType.FLOAT32
        elif all(type(v) is int for v in val):
            sub_type = gguf.GGUFValueType.INT32
        else:
            return None
    fmt = {gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.INT32: "i", gguf.GGUFValueType.UINT32: "I",
           gguf.GGUFValueType.FLOAT64: "d", gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.UINT64: "Q"}.get(sub_type)
    return (int(sub_type), fmt) if fmt else None


def write_gguf_models(
    targets: list[tuple[Path, GGUFModelPlan, int]],
    vocab: GGUFVocab,
    read: Callable[[str], torch.Tensor],
    *,
    name: str,
    progress: Progress | None = None,
) -> dict[Path, str]:
    """One pass over the source feeds every target ``(path, plan, file_type)``: each tensor is read and
    transformed once, then converted and written to every file. Plans differ only in tensor types.
    Returns each file's sha256, computed while writing."""
    import gguf

    writers = []
    for out, plan, file_type in targets:
        writer = _hashing_writer(out, plan.graph_name)
        n_vocab = next(t.shape[0] for t in plan.tensors if t.gguf_name == "token_embd.weight")
        write_hparams(writer, plan, n_vocab=n_vocab, file_type=file_type, name=name)
        vocab.write(writer)
        for tp in plan.tensors:
            q = gguf.GGMLQuantizationType[tp.qtype]
            if tp.qtype in ("F32", "F16"):
                dtype = np.float32 if tp.qtype == "F32" else np.float16
                writer.add_tensor_info(tp.gguf_name, tp.shape, np.dtype(dtype), tp.nbytes)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(tp.shape, q)
                writer.add_tensor_info(tp.gguf_name, byte_shape, np.dtype(np.uint8), tp.nbytes, raw_dtype=q)
        writer.write_header_to_file(out)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writers.append(writer)
    lead = targets[0][1]
    total = sum(t.nbytes for t in lead.tensors)
    done = 0
    for i, tp in enumerate(lead.tensors):
        if tp.stack:  # a layer's experts of one projection, [E, rows, cols]
            t = torch.stack([read(name) for name in tp.stack])
        else:
            t = lead.extra[tp.gguf_name] if not tp.hf_name else read(tp.hf_name)
        if tp.transform is not None:
            t = tp.transform(t)
        for writer, (_, plan, _) in zip(writers, targets, strict=True):
            writer.write_tensor_data(to_gguf_array(t, plan.tensors[i].qtype))
        done += tp.nbytes
        if progress:
            progress(done, total, tp.gguf_name)
    hashes = {}
    for writer, (out, _, _) in zip(writers, targets, strict=True):
        writer.flush()
        hashes[out] = writer.sha256()
        writer.close()
    return hashes
