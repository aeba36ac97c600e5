"""Per architecture: which transformers classes run one decoder block, and which linears share an input
(each group's per-channel scale is folded into the operation before it). Data, not code: adding an
architecture is a row here once its block matches one of these shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError


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


@dataclass(frozen=True)
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
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


GEMMA_GROUPS = (
    ScaleGroup("input_layernorm", "norm_plus_one", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),
    ScaleGroup("pre_feedforward_layernorm", "norm_plus_one", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)
OLMO2_GROUPS = (  # norms after attention and MLP: nothing to fold q/k/v's or gate/up's scales into
    ScaleGroup(None, "none", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),
    ScaleGroup(None, "none", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)


def _phi3_v_rows(cfg) -> slice:
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    return slice(q + kv, q + 2 * kv)


PHI3_GROUPS = (  # q/k/v and gate/up fused on disk: one linear each; o and down read rows of them
    ScaleGroup("input_layernorm", "norm", ("self_attn.qkv_proj",)),
    ScaleGroup("self_attn.qkv_proj", "linear", ("self_attn.o_proj",), prev_rows=_phi3_v_rows),
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_up_proj",)),
    ScaleGroup("mlp.gate_up_proj", "linear", ("mlp.down_proj",),
               prev_rows=lambda cfg: slice(cfg.intermediate_size, 2 * cfg.intermediate_size)),
)


def _gemma_embed_scale(cfg):
    import torch

    return torch.tensor(cfg.hidden_size**0.5)  # transformers keeps it as a (float32) tensor


def _arch(name: str, prefix: str, groups: tuple[ScaleGroup, ...] = LLAMA_GROUPS, **kw) -> AWQArch:
    return AWQArch(f"transformers.models.{name}.modeling_{name}", f"{prefix}DecoderLayer",
                   f"{prefix}RotaryEmbedding", f"{prefix}RMSNorm", groups=groups, **kw)


AWQ_ARCHS: dict[str, AWQArch] = {
    "llama": _arch("llama", "Llama"),
    "mistral": _arch("mistral", "Mistral"),
    "qwen2": _arch("qwen2", "Qwen2"),
    "qwen3": _arch("qwen3", "Qwen3"),
    "smollm3": _arch("smollm3", "SmolLM3"),
    "granite": _arch("granite", "Granite", embed_scale=lambda cfg: cfg.embedding_multiplier),
    "gemma3_text": AWQArch("transformers.models.gemma3.modeling_gemma3", "Gemma3DecoderLayer",
                           "Gemma3RotaryEmbedding", "Gemma3RMSNorm", groups=GEMMA_GROUPS,
                           embed_scale=_gemma_embed_scale),
    "gemma2": _arch("gemma2", "Gemma2", GEMMA_GROUPS, embed_scale=_gemma_embed_scale),
    "olmo2": _arch("olmo2", "Olmo2", OLMO2_GROUPS),
    "phi3": _arch("phi3", "Phi3", PHI3_GROUPS, no_clip=("self_attn.qkv_proj",)),
    "mixtral": _arch("mixtral", "Mixtral", ATTENTION_GROUPS, moe_norm="post_attention_layernorm"),
    "qwen3_moe": _arch("qwen3_moe", "Qwen3Moe", ATTENTION_GROUPS, moe_norm="post_attention_layernorm",
                       sparse_layers=(("mlp_only_layers", []), ("decoder_sparse_step", 1))),
}
# Why the others are not in the table (told to the user).
NOT_SUPPORTED: dict[str, str] = {}


def calibrated_model_type(model_type: str) -> str:
    """The architecture AWQ calibrates for ``model_type``: a multimodal checkpoint's text model."""
    from ..multimodal import TEXT_TOWERS

    tower = TEXT_TOWERS.get(model_type)
    return tower.text_model_type if tower else model_type


def awq_refusal(model_type: str) -> str | None:
    """Why AWQ refuses ``model_type``, or None."""
    model_type = calibrated_model_type(model_type)
    return None if model_type in AWQ_ARCHS else NOT_SUPPORTED.get(model_type, "no AWQ table entry")


def dense_layers_refusal(arch: AWQArch, config: dict) -> str | None:
    """Why a mixture-of-experts model with dense MLP layers among its sparse ones cannot be calibrated, or None."""
    off = [f"{key} {config[key]!r}" for key, sparse in arch.sparse_layers
           if config.get(key, sparse) not in (sparse, None)]
    if off:
        return (f"this {config.get('model_type')} has dense MLP layers among its sparse ones ({', '.join(off)}), "
                "which the calibration pass does not run")
    return None


def awq_arch_for(model_type: str) -> AWQArch:
    if (why := awq_refusal(model_type)) is None:
        return AWQ_ARCHS[calibrated_model_type(model_type)]
    raise UserError(f"AWQ does not support architecture {model_type!r} ({why})",
                    f"supported: {', '.join(sorted(AWQ_ARCHS))}; use --target vllm or gguf for this base")
