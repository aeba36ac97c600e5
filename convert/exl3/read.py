"""Read an EXL3 directory (what exllamav3's converter writes) and decode its linears on any machine.

Layout: an HF directory whose ``config.json`` has ``quantization_config.quant_method == "exl3"`` (with ``bits``,
``head_bits``, ``codebook``, ``version``). Each quantized linear ``<key>`` stores ``<key>.trellis`` (I16
``[in/16, out/16, 16K]``), ``<key>.suh`` (F16 ``[in]``), ``<key>.svh`` (F16 ``[out]``), optionally a 0-dim int32
marker ``<key>.mcg`` or ``<key>.mul1`` holding its codebook's multiplier, and ``<key>.bias``; dimensions padded to
multiples of 128 (the head's vocabulary too: slice logits to ``vocab_size``). Embeddings, norms, routers and
linears left unquantized keep ``.weight`` (fp16 or bf16). Mixture-of-experts blocks are stored one linear per
expert, under the names of exllamav3's architecture file (``<block>.experts.<e>.w1``/``w3``/``w2`` for Mixtral,
``mlp.experts.<e>.gate_proj``/``up_proj``/``down_proj`` for Qwen3-MoE), whether the source kept them per expert
or fused.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from ..errors import UserError
from .codebook import codebook_of, marker_problem
from .hadamard import reconstruct
from .trellis import TILE, Bits, bits_from_width, decode

QUANT_METHOD = "exl3"
TRELLIS, SUH, SVH = "trellis", "suh", "svh"
MEMORY_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's projections as transformers 5 names them
LEGACY_SIGNS = ("su", "sv")  # exllamav3's first layout: packed sign bits instead of fp16 scale vectors
DECODE_ROWS = 1024  # input rows decoded at a time (a multiple of 128: the rotations work on 128-row blocks)
# Linears exllamav3 stores split where the HF checkpoint keeps them fused (its architecture files slice the
# fused weight by output rows): fused module -> [(part, config keys whose product is the part's rows)]
FUSED_PARTS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qkv_proj": (("q_proj", ("num_attention_heads", "head_dim")), ("k_proj", ("num_key_value_heads", "head_dim")),
                 ("v_proj", ("num_key_value_heads", "head_dim"))),
    "gate_up_proj": (("gate_proj", ("intermediate_size",)), ("up_proj", ("intermediate_size",))),
}


def is_exl3(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD


@dataclass(frozen=True)
class Exl3Linear:
    key: str  # e.g. model.layers.0.self_attn.q_proj
    bits: Bits  # K: 1..8, or a half-integer (exllamav3 1.6, mul1)
    codebook: str
    in_features: int  # as stored (padded to 128)
    out_features: int


class Exl3Model:
    """An EXL3 directory: its quantization settings and its linears, each decoded on demand. Trellis tables that
    are not linears (exllamav3 1.6's quantized embeddings and n-gram tables: no suh/svh) are listed in
    ``other_tables`` and not decoded."""

    def __init__(self, path: str | Path) -> None:
        self.ckpt = Checkpoint(path)
        self.path = self.ckpt.path
        if not is_exl3(self.ckpt.config):
            raise UserError(f"{self.path} is not an EXL3 model (config.json has no quantization_config with "
                            f"quant_method exl3)", "pass a directory written by exllamav3's converter")
        self.quantization: dict = self.ckpt.config["quantization_config"]
        names = set(self.ckpt.names())
        self.linears: dict[str, Exl3Linear] = {}
        self.other_tables: list[str] = []
        for name in sorted(n for n in names if n.endswith(f".{TRELLIS}")):
            key = name[: -len(TRELLIS) - 1]
            if f"{key}.{SUH}" not in names or f"{key}.{SVH}" not in names:
                if all(f"{key}.{part}" in names for part in LEGACY_SIGNS):
                    raise UserError(f"{self.path}: {key} uses exllamav3's early layout (packed su/sv signs), "
                                    "which tuneport does not decode", "convert the model again with exllamav3 1.4+")
                self.other_tables.append(key)
                continue
            self.linears[key] = self._linear(key, name, names)

    def _linear(self, key: str, name: str, names: set[str]) -> Exl3Linear:
        shape = self.ckpt.meta(name).shape
        if len(shape) != 3:
            raise UserError(f"{self.path}: {name} has shape {list(shape)}, not [in/16, out/16, 16*K]",
                            "the EXL3 directory is corrupt: convert it again")
        try:
            k = bits_from_width(shape[-1])
        except ValueError as e:
            raise UserError(f"{self.path}: {name}: {e}", "the EXL3 directory is corrupt: convert it again") from None
        codebook = codebook_of(names, key)
        if codebook != "3inst" and (problem := marker_problem(codebook, self.ckpt.read(f"{key}.{codebook}"))):
            raise UserError(f"{self.path}: the codebook marker {key}.{codebook} {problem}: a codebook tuneport "
                            "cannot decode (exllamav3 writes the multiplier, fixed since its 0.0.9)",
                            "convert the model again with exllamav3 0.0.9 or later")
        if not float(k).is_integer() and codebook != "mul1":
            raise UserError(f"{self.path}: {key} has {k} bits per weight with the {codebook} codebook (exllamav3 "
                            "writes half-integer bitrates with mul1 only)", "the EXL3 directory is corrupt")
        return Exl3Linear(key, k, codebook, shape[0] * TILE, shape[1] * TILE)

    def weight_rows(self, key: str, rows: int = DECODE_ROWS) -> Iterator[tuple[int, torch.Tensor]]:
        """exllamav3's weight [in, out] (fp32) of linear ``key``, ``rows`` input rows at a time: (first row, rows
        × out). Memory stays a few times one block, whatever the layer's size (a 128k-row head included)."""
        lin = self.linears[key]
        trellis = self.ckpt.read(f"{key}.{TRELLIS}")
        suh, svh = self.ckpt.read(f"{key}.{SUH}"), self.ckpt.read(f"{key}.{SVH}")
        step = rows // TILE
        for t in range(0, trellis.shape[0], step):
            r = t * TILE
            yield r, reconstruct(decode(trellis[t: t + step], lin.codebook), suh[r: r + rows], svh)

    def weight(self, key: str) -> torch.Tensor:
        """The linear's weight as ``nn.Linear`` holds it, [out, in] fp32 (padded dims kept)."""
        return torch.cat([w for _, w in self.weight_rows(key)]).T.contiguous()

    def layer_bits(self) -> dict[str, Counter]:
        """Per decoder layer (or top-level module): how many linears have each (K, codebook)."""
        out: dict[str, Counter] = {}
        for lin in self.linears.values():
            parts = lin.key.split(".")
            group = ".".join(parts[:3]) if len(parts) > 3 and parts[2].isdigit() else parts[0]
            out.setdefault(group, Counter())[(lin.bits, lin.codebook)] += 1
        return out

    def summary(self) -> dict:
        """What ``tuneport inspect`` shows: settings, bits per weight overall and per layer, the codebooks."""
        q = self.quantization
        weights = {k: lin.in_features * lin.out_features for k, lin in self.linears.items()}
        total = sum(weights.values()) or 1
        layers = {g: ", ".join(f"{n}x {k}-bit {cb}" for (k, cb), n in sorted(c.items()))
                  for g, c in self.layer_bits().items()}
        return {
            "format": "exl3", "version": q.get("version"), "bits": q.get("bits"), "head_bits": q.get("head_bits"),
            "codebook": q.get("codebook"), "quantized_linears": len(self.linears),
            "codebooks": sorted({lin.codebook for lin in self.linears.values()}),
            "average_bits": round(sum(self.linears[k].bits * n for k, n in weights.items()) / total, 3),
            "layers": layers, "other_tables": self.other_tables,
        }


def expert_reference(reference: Checkpoint, key: str) -> str | None:
    """The checkpoint's tensor for an expert linear ``key`` (``<layer>.<block>.experts.<e>.<projection>``), the block
    and projection named either as on disk (Mixtral ``block_sparse_moe``, ``w1``/``w3``/``w2``) or as transformers
    5 names them (``mlp``, ``gate_proj``/``up_proj``/``down_proj``); fused experts are served per expert by
    ``Checkpoint``. None for other keys and dense models."""
    layout = reference.arch.experts if reference.arch else None
    m = re.fullmatch(r"(.*\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)", key)
    if layout is None or m is None or m[2] not in (layout.disk_block, layout.memory_block):
        return None
    disk = dict(zip(MEMORY_PROJECTIONS, (layout.gate, layout.up, layout.down), strict=True)).get(m[4], m[4])
    name = f"{m[1]}.{layout.disk_block}.experts.{m[3]}.{disk}.weight"
    return name if name in reference else None


def reference_rows(reference: Checkpoint, key: str, tied_head: str | None) -> torch.Tensor | None:
    """The unquantized weight [out, in] exllamav3 quantized as ``key``: the tensor of that name, an expert's
    projection, the tied embedding for a head the checkpoint does not store, or the part's rows of a fused linear
    it split."""
    if f"{key}.weight" in reference:
        return reference.read(f"{key}.weight")
    if expert := expert_reference(reference, key):
        return reference.read(expert)
    if key == "lm_head" and tied_head and tied_head in reference:
        return reference.read(tied_head)
    parent, _, part = key.rpartition(".")
    for fused, parts in FUSED_PARTS.items():
        if part in dict(parts) and f"{parent}.{fused}.weight" in reference:
            sizes = dict(part_rows(reference.config, fused))
            names = list(sizes)
            start = sum(sizes[n] for n in names[: names.index(part)])
            return reference.read(f"{parent}.{fused}.weight")[start: start + sizes[part]]
    return None


def part_rows(config: dict, fused: str) -> list[tuple[str, int]]:
    """(part, rows) of a fused linear exllamav3 stores split (``FUSED_PARTS``), from the model's config."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    values = {**config, "head_dim": head_dim}
    return [(part, math.prod(int(values[k]) for k in keys)) for part, keys in FUSED_PARTS[fused]]


def relative_errors(model: Exl3Model, reference: Checkpoint, tied_head: str | None = None) -> dict[str, float]:
    """Per quantized linear: ||decoded - reference|| / ||reference|| against the unquantized weights it was
    converted from (the decoded weight cut to the reference's shape: EXL3 pads to 128), one block of rows at a
    time. A linear with no reference is refused: a check that skips layers proves nothing."""
    out = {}
    for key in model.linears:
        ref = reference_rows(reference, key, tied_head)
        if ref is None:
            raise UserError(f"{model.path}: no unquantized weight for {key} in {reference.path}",
                            "compare against the directory the EXL3 was converted from")
        ref_t = ref.float().T  # [in, out]
        err = norm = 0.0
        for r, w in model.weight_rows(key):
            part = ref_t[r: r + w.shape[0]]
            if part.shape[0] == 0:
                break
            err += float((w[: part.shape[0], : part.shape[1]] - part).pow(2).sum())
            norm += float(part.pow(2).sum())
        out[key] = (err / max(norm, 1e-30)) ** 0.5
    return out
