"""Per architecture: which transformers classes run one decoder block, and which linears share an input
(each group's per-channel scale is folded into the operation before it). Data, not code: adding an
architecture is a row here once its block matches one of these shapes."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that read the output of ``prev``; ``prev_kind`` is "norm" (RMSNorm weight) or "linear"
    (its output rows and bias)."""

    prev: str
    prev_kind: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class AWQArch:
    module: str  # transformers module holding the classes
    layer_class: str
    rotary_class: str
    norm_class: str
    final_norm: str = "model.norm"
    groups: tuple[ScaleGroup, ...] = ()
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")  # feed attention scores: no clipping

    @property
    def linears(self) -> tuple[str, ...]:
        """Every linear a block quantizes, in group order."""
        return tuple(n for g in self.groups for n in g.linears)


LLAMA_GROUPS = (
    ScaleGroup("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),  # only when v_proj feeds o_proj 1:1 (no GQA)
    ScaleGroup("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)


# vLLM runs these linears as one fused module (names inside a block): quantized all together or not at all.
FUSED_SETS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _arch(name: str, prefix: str) -> AWQArch:
    return AWQArch(f"transformers.models.{name}.modeling_{name}", f"{prefix}DecoderLayer",
                   f"{prefix}RotaryEmbedding", f"{prefix}RMSNorm", groups=LLAMA_GROUPS)


AWQ_ARCHS: dict[str, AWQArch] = {
    "llama": _arch("llama", "Llama"),
    "mistral": _arch("mistral", "Mistral"),
    "qwen2": _arch("qwen2", "Qwen2"),
    "qwen3": _arch("qwen3", "Qwen3"),
    "smollm3": _arch("smollm3", "SmolLM3"),
}
# Why the others are not in the table (told to the user).
NOT_SUPPORTED = {
    "gemma3_text": "Gemma stores norm weights as w - 1 and scales embeddings; its folding is not implemented",
    "phi3": "fused qkv_proj / gate_up_proj need split scale groups; not implemented",
    "gemma2": "Gemma stores norm weights as w - 1 and scales embeddings; its folding is not implemented",
    "granite": "the calibration pass does not apply embedding_multiplier before the first block yet",
    "olmo2": "its norms follow attention and MLP, so no norm precedes q/k/v or gate/up to fold scales into",
    **dict.fromkeys(("mixtral", "qwen3_moe"), "mixture of experts: the calibration pass runs dense MLPs only (each "
                    "expert's scales need the tokens the router sends it); not implemented"),
}


def awq_refusal(model_type: str) -> str | None:
    """Why AWQ refuses ``model_type``, or None."""
    return None if model_type in AWQ_ARCHS else NOT_SUPPORTED.get(model_type, "no AWQ table entry")


def awq_arch_for(model_type: str) -> AWQArch:
    if (why := awq_refusal(model_type)) is None:
        return AWQ_ARCHS[model_type]
    raise UserError(f"AWQ does not support architecture {model_type!r} ({why})",
                    f"supported: {', '.join(sorted(AWQ_ARCHS))}; use --target vllm or gguf for this base")
