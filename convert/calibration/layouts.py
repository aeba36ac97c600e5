"""The vocabulary of an architecture's calibration layout (an entry of ``convert.arch`` holds one ``AWQArch``):
which transformers classes run one decoder block, and which linears share an input (each group's per-channel
scale is folded into the operation before it), with the group shapes the architectures share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read the output of ``prev``, where their per-channel scale is folded. ``prev_kind``:
    "norm" (an RMSNorm weight w: w / s), "norm_plus_one" (Gemma's stored w - 1 of the weight 1 + w:
    (1 + w) / s - 1), "linear" (its output rows and bias; ``prev_rows(config)`` the rows that feed the group
    when ``prev`` is fused, e.g. v inside phi3's qkv_proj), or "none" (nothing foldable precedes the group,
    as in OLMo 2 whose norms follow attention and MLP: no scale, clipping only)."""

    prev: str | None
    prev_kind: str
    linears: tuple[str, ...]
    prev_rows: Callable[[Any], slice] | None = None


@dataclass(frozen=True, eq=False)
class AWQArch:
    module: str  # transformers module holding the classes
    layer_class: str
    rotary_class: str
    norm_class: str
    final_norm: str = "model.norm"
    groups: tuple[ScaleGroup, ...] = ()
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")  # feed attention scores: no clipping
    # what the model multiplies the token embeddings by before the first block (Gemma: sqrt(hidden), as the
    # tensor transformers keeps; Granite: embedding_multiplier), from the transformers config
    embed_scale: Callable[[Any], Any] | None = None
    # mixture of experts: the norm before the router and every expert (one scale for the router and all the
    # experts' gate/up, folded there; each expert's down_proj scaled into its own up rows). None: dense MLP.
    moe_norm: str | None = None
    # config values (transformers' defaults where absent) that keep every layer of a mixture sparse: another value
    # puts dense MLP layers among the sparse ones, which one table entry per architecture cannot describe
    sparse_layers: tuple[tuple[str, Any], ...] = ()
    # linears besides the router and the experts that read ``moe_norm``'s output (Qwen2-MoE's shared expert and its
    # gate): their columns take the experts' scale
    moe_shared: tuple[str, ...] = ()

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear a block quantizes, in group order."""
        return tuple(n for g in self.groups for n in g.linears)


ATTENTION_GROUPS = (
    ScaleGroup("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),  # only when v_proj feeds o_proj 1:1 (no GQA)
)
LLAMA_GROUPS = (
    *ATTENTION_GROUPS,
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)


# vLLM runs these linears as one fused module (names inside a block): quantized all together or not at all.
FUSED_SETS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
              "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")}


GEMMA_GROUPS = (
    ScaleGroup("input_layernorm", "norm_plus_one", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),
    ScaleGroup("pre_feedforward_layernorm", "norm_plus_one", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)
def gemma_embed_scale(cfg):
    import torch

    return torch.tensor(cfg.hidden_size**0.5)  # transformers keeps it as a (float32) tensor


def transformers_layout(name: str, prefix: str, groups: tuple[ScaleGroup, ...] = LLAMA_GROUPS, **kw) -> AWQArch:
    return AWQArch(f"transformers.models.{name}.modeling_{name}", f"{prefix}DecoderLayer",
                   f"{prefix}RotaryEmbedding", f"{prefix}RMSNorm", groups=groups, **kw)
