"""Architecture knowledge as data: one entry per Hugging Face ``model_type``.

Adding an architecture means adding an entry here (and a tiny model + test in ``toolkit.tiny``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UserError

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_LINEARS = (*ATTENTION_LINEARS, "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertLayout:
    """Where a mixture-of-experts block keeps its weights: transformers 5 fuses each layer's experts into
    3-D parameters in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) but saves
    them per expert, under the names checkpoints have always used."""

    disk_block: str  # the MoE block's name on disk (``block_sparse_moe`` for Mixtral, ``mlp`` for Qwen3-MoE)
    gate: str  # per-expert gate projection on disk (first half of gate_up_proj)
    up: str  # per-expert up projection (second half)
    down: str
    expert_count_keys: tuple[str, ...] = ("num_local_experts", "num_experts")
    memory_block: str = "mlp"  # the block's name in transformers 5's module tree
    router: str = "gate"  # the router (a [E, H] linear) inside the block, both in memory and on disk

    def expert_count(self, config: dict) -> int:
        count = next((config[k] for k in self.expert_count_keys if config.get(k) is not None), None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise UserError(f"config.json gives no expert count ({' or '.join(self.expert_count_keys)}: {count!r})",
                            "add the number of experts per layer to config.json")
        return count


@dataclass(frozen=True)
class ArchSpec:
    """What tuneport knows about one architecture."""

    model_type: str
    hf_classes: tuple[str, ...]
    gguf_arch: str
    # "normal": llama-family RoPE, needs the q/k row permutation in GGUF; "neox": no permutation.
    rope_style: str
    embed: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    final_norm: str = "model.norm"
    layer_prefix: str = "model.layers"
    linear_modules: tuple[str, ...] = LLAMA_LINEARS
    # Module suffixes each engine accepts a LoRA on (read from the engine's own model classes).
    vllm_lora_modules: tuple[str, ...] = LLAMA_LINEARS
    exl3_loads_lora: bool = False  # ExLlamaV3 (TabbyAPI) loads no LoRA: merge first
    # transformers' attention implementation for the reference, where its default computes something else
    reference_attention: str | None = None
    experts: ExpertLayout | None = None  # a mixture-of-experts architecture
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def embedding_modules(self) -> tuple[str, ...]:
        return (self.embed.rsplit(".", 1)[-1], self.lm_head.rsplit(".", 1)[-1])


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "llama",
        ("LlamaForCausalLM",),
        gguf_arch="llama",
        rope_style="normal",
        # vLLM's LlamaForCausalLM declares embedding_modules {embed_tokens, lm_head}.
        vllm_lora_modules=LLAMA_LINEARS + ("embed_tokens", "lm_head"),
    ),
    "mistral": ArchSpec(
        "mistral",
        ("MistralForCausalLM",),
        gguf_arch="llama",
        rope_style="normal",
        notes=("vLLM: 'We don't support LoRA on the embedding layers' for Mistral",),
    ),
    "qwen2": ArchSpec(
        "qwen2",
        ("Qwen2ForCausalLM",),
        gguf_arch="qwen2",
        rope_style="neox",
        notes=("q/k/v projections carry biases",),
    ),
    "qwen3": ArchSpec(
        "qwen3",
        ("Qwen3ForCausalLM",),
        gguf_arch="qwen3",
        rope_style="neox",
        notes=("per-head q_norm / k_norm",),
    ),
    "gemma3_text": ArchSpec(
        "gemma3_text",
        ("Gemma3ForCausalLM",),
        gguf_arch="gemma3",
        rope_style="neox",
        notes=("norm weights stored as w - 1", "embeddings scaled by sqrt(hidden)", "sliding-window layers"),
    ),
    "phi3": ArchSpec(
        "phi3",
        ("Phi3ForCausalLM",),
        gguf_arch="phi3",
        rope_style="neox",
        linear_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        vllm_lora_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        notes=("fused qkv_proj and gate_up_proj",),
    ),
    "gemma2": ArchSpec(
        "gemma2",
        ("Gemma2ForCausalLM",),
        gguf_arch="gemma2",
        rope_style="neox",
        notes=("norm weights stored as w - 1", "embeddings scaled by sqrt(hidden)", "attention and final logit "
               "soft-capping", "every 2nd layer global, the others sliding-window",
               "the reference runs transformers' eager attention: its default sdpa drops attn_logit_softcapping "
               "(measured: logits 8.8e-3 apart on the tiny model)"),
        reference_attention="eager",
    ),
    "olmo2": ArchSpec(
        "olmo2",
        ("Olmo2ForCausalLM",),
        gguf_arch="olmo2",
        rope_style="neox",
        notes=("norms after attention and MLP (no input norm); q/k norms over all heads",),
    ),
    "granite": ArchSpec(
        "granite",
        ("GraniteForCausalLM",),
        gguf_arch="granite",
        rope_style="normal",
        notes=("embedding, attention, residual and logit multipliers (carried as GGUF scales)",),
    ),
    "smollm3": ArchSpec(
        "smollm3",
        ("SmolLM3ForCausalLM",),
        gguf_arch="smollm3",
        rope_style="normal",
        notes=("every 4th layer without RoPE (no_rope_layers)",),
    ),
    # Gemma 3 4B-27B as a whole (text and vision), for the targets that keep the whole checkpoint (merge, vLLM, AWQ);
    # text-only targets export its text model (convert/multimodal.py). Names: the hub's layout.
    "gemma3": ArchSpec(
        "gemma3",
        ("Gemma3ForConditionalGeneration",),
        gguf_arch="gemma3",
        rope_style="neox",
        embed="language_model.model.embed_tokens",
        lm_head="language_model.lm_head",
        final_norm="language_model.model.norm",
        layer_prefix="language_model.model.layers",
        notes=("multimodal: merge, vLLM and AWQ keep the vision tower (an adapter on it merged too; vLLM serves LoRA "
               "on the language model; AWQ quantizes the language model only); GGUF and MLX export the text model",),
    ),
    "mixtral": ArchSpec(
        "mixtral",
        ("MixtralForCausalLM",),
        gguf_arch="llama",
        rope_style="normal",
        linear_modules=ATTENTION_LINEARS,  # the experts' projections are per expert (ExpertLayout)
        vllm_lora_modules=ATTENTION_LINEARS,
        experts=ExpertLayout("block_sparse_moe", "w1", "w3", "w2"),
        notes=("mixture of experts: a router and per-expert w1/w3/w2 under block_sparse_moe on disk (transformers 5 "
               "fuses them into mlp.experts in memory)",),
    ),
    "qwen3_moe": ArchSpec(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        gguf_arch="qwen3moe",
        rope_style="neox",
        linear_modules=ATTENTION_LINEARS,  # the experts' projections are per expert (ExpertLayout)
        vllm_lora_modules=ATTENTION_LINEARS,
        experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj"),
        notes=("mixture of experts: a router and per-expert gate/up/down projections; per-head q_norm / k_norm",),
    ),
}


def arch_for(model_type: str | None) -> ArchSpec:
    """The entry for ``model_type``, or a UserError that lists the supported ones."""
    if not model_type:
        raise UserError("config.json names no model_type",
                        f"add the model_type of its architecture (tuneport supports: {', '.join(sorted(ARCHS))})")
    try:
        return ARCHS[str(model_type)]
    except KeyError:
        raise UserError(
            f"unsupported architecture {model_type!r}",
            f"tuneport supports: {', '.join(sorted(ARCHS))}",
        ) from None


def known_arch(model_type: str | None) -> ArchSpec | None:
    return ARCHS.get(str(model_type))
