"""Read an EXL3 directory (what exllamav3's converter writes) and decode its linears on any machine.

Layout: an HF directory whose ``config.json`` has ``quantization_config.quant_method == "exl3"`` (with ``bits``,
``head_bits``, ``codebook``, ``version``). Each quantized linear ``<key>`` stores ``<key>.trellis`` (I16
``[in/16, out/16, 16K]``), ``<key>.suh`` (F16 ``[in]``), ``<key>.svh`` (F16 ``[out]``), optionally a 0-dim
marker ``<key>.mcg`` or ``<key>.mul1`` and ``<key>.bias``; dimensions padded to multiples of 128 (the head's
vocabulary too: slice logits to ``vocab_size``). Embeddings, norms and linears left unquantized keep
``.weight`` (fp16 or bf16).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from ..errors import UserError
from .codebook import codebook_of
from .hadamard import reconstruct
from .trellis import TILE, Bits, bits_from_width, decode

QUANT_METHOD = "exl3"
TRELLIS, SUH, SVH = "trellis", "suh", "svh"


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
    bias: bool


class Exl3Model:
    """An EXL3 directory: its quantization settings and its linears, each decoded on demand."""

    def __init__(self, path: str | Path) -> None:
        self.ckpt = Checkpoint(path)
        self.path = self.ckpt.path
        if not is_exl3(self.ckpt.config):
            raise UserError(f"{self.path} is not an EXL3 model (config.json has no quantization_config with "
                            f"quant_method exl3)", "pass a directory written by exllamav3's converter")
        self.quantization: dict = self.ckpt.config["quantization_config"]
        names = set(self.ckpt.names())
        self.linears: dict[str, Exl3Linear] = {}
        for name in sorted(names):
            if not name.endswith(f".{TRELLIS}"):
                continue
            key = name[: -len(TRELLIS) - 1]
            shape = self.ckpt.meta(name).shape
            for part in (SUH, SVH):
                if f"{key}.{part}" not in names:
                    raise UserError(f"{self.path}: {key} has a trellis but no {part}",
                                    "the EXL3 directory is incomplete: convert it again")
            if len(shape) != 3:
                raise UserError(f"{self.path}: {name} has shape {list(shape)}, not [in/16, out/16, 16*K]",
                                "the EXL3 directory is corrupt: convert it again")
            try:
                k = bits_from_width(shape[-1])
            except ValueError as e:
                raise UserError(f"{self.path}: {name}: {e}",
                                "the EXL3 directory is corrupt: convert it again") from None
            self.linears[key] = Exl3Linear(key, k, codebook_of(names, key), shape[0] * TILE, shape[1] * TILE,
                                           f"{key}.bias" in names)

    def weight(self, key: str) -> torch.Tensor:
        """The linear's weight as ``nn.Linear`` holds it, [out, in] fp32 (padded dims kept)."""
        lin = self.linears[key]
        trellis = self.ckpt.read(f"{key}.{TRELLIS}")
        w = reconstruct(decode(trellis, lin.codebook), self.ckpt.read(f"{key}.{SUH}"), self.ckpt.read(f"{key}.{SVH}"))
        return w.T.contiguous()

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
            "layers": layers,
        }


def relative_errors(model: Exl3Model, reference: Checkpoint, tied_head: str | None = None) -> dict[str, float]:
    """Per quantized linear: ||decoded - reference|| / ||reference|| against the unquantized weights it was
    converted from (the decoded weight cut to the reference's shape: EXL3 pads to 128). ``tied_head``: the
    embedding the head was quantized from when the reference has no ``lm_head.weight``."""
    out = {}
    for key in model.linears:
        name = f"{key}.weight"
        if name not in reference and key == "lm_head" and tied_head:
            name = tied_head
        if name not in reference:
            continue
        ref = reference.read(name).float()
        got = model.weight(key)[: ref.shape[0], : ref.shape[1]]
        out[key] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    return out
