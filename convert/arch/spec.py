"""What one architecture is, for every target: the shape of an entry of ``convert.arch`` (one module per
``model_type``). Each target's facts are a value of that target's own vocabulary (``gguf.arch_facts``,
``gguf.config_rules``, ``mlx.arch_facts``, ``calibration.layouts``), which imports nothing of this package."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..errors import UserError
from ..vllm_facts import VllmFacts

if TYPE_CHECKING:
    from ..calibration.layouts import AWQArch
    from ..gguf.arch_facts import GGUFArch
    from ..mlx.arch_facts import MlxArch

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
    # gpt-oss's and Llama 4's layout, in memory and on disk alike: ``experts.gate_up_proj [E, H, 2I]`` ([in, out]),
    # ``down_proj [E, I, H]``; gpt-oss's with a bias each (``gate_up_proj_bias [E, 2I]``) or the two weights as MXFP4
    # ``_blocks`` / ``_scales`` ([E, out, in / 32, 16], [E, out, in / 32]). Readers still see one tensor per expert
    # (``experts.{e}.gate_proj.weight`` and ``.bias``); the merged checkpoint is written fused again.
    stored_in_out: bool = False
    # the gate and up columns of ``gate_up_proj`` interleaved (gpt-oss), not its two halves (Llama 4)
    interleaved_gate_up: bool = False
    # PEFT's LoRA on the fused [E, in, out] parameters is transposed (delta = (B A)ᵀ of the weight): PEFT takes a 3-D
    # parameter for [E, out, in] unless transformers marks its experts ``is_transposed`` (gpt-oss's; Llama 4's not).
    # Told from the shapes where they differ; this where they cannot (square projections)
    peft_transposed: bool = False

    def expert_count(self, config: dict) -> int:
        """Experts per layer: from ``config``, or a multimodal checkpoint's ``text_config``."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        count = next((c[k] for c in (config, text) for k in self.expert_count_keys if c.get(k) is not None), None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise UserError(f"config.json gives no expert count ({' or '.join(self.expert_count_keys)}: {count!r})",
                            "add the number of experts per layer to config.json")
        return count


@dataclass(frozen=True)
class SplitLinear:
    """A fused linear (module suffix inside a layer) an engine keeps apart as the modules its output rows are, equal
    blocks in order (one part: a rename); ``convert.split_linears`` applies it to tensors and LoRA."""

    fused: str  # e.g. "shared_mlp.input_linear"
    parts: tuple[str, ...]  # e.g. ("mlp.gate_proj", "mlp.up_proj")


@dataclass(frozen=True)
class TextTower:
    """A multimodal checkpoint's text model, which text-only targets export as a checkpoint of its own."""

    text_model_type: str  # the text model's model_type, an architecture of this package
    config_class: str  # transformers config class that fills the text_config's defaults
    renames: tuple[tuple[str, str], ...]  # name prefix in the checkpoint or adapter -> in the text model
    vision: tuple[str, ...]  # prefixes of the parts text-only targets drop
    # transformers 5's module names (PEFT's) -> the checkpoint's, for targets that keep the whole checkpoint
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    inherited: tuple[str, ...] = ("tie_word_embeddings",)  # top-level keys the text model takes
    # (prefix, layout vLLM loads): transformers 5 saves SigLIP without its ``vision_model`` level, which vLLM
    # 0.32 cannot load ("no module or parameter named 'vision_tower.embeddings'"); the hub's layout has it
    vllm_renames: tuple[tuple[str, str], ...] = ()
    # a text-model name prefix -> the whole model's (transformers 5's, PEFT's), for targets that quantize the text
    # model and write the whole checkpoint (AWQ)
    memory_prefixes: tuple[tuple[str, str], ...] = ()
    keep_16bit: tuple[str, ...] = ()  # compressed-tensors ignore patterns for the parts left unquantized


@dataclass(frozen=True, eq=False)  # one instance per architecture: compared and hashed by identity
class ArchSpec:
    """What tuneport knows about one architecture."""

    model_type: str
    hf_classes: tuple[str, ...]
    gguf_arch: str
    # "normal": llama-family RoPE, needs the q/k row permutation in GGUF; "neox": no permutation; "interleaved":
    # RoPE on interleaved pairs in the checkpoint already (llama.cpp's NORM type), no permutation.
    rope_style: str
    embed: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    final_norm: str = "model.norm"
    layer_prefix: str = "model.layers"
    linear_modules: tuple[str, ...] = LLAMA_LINEARS
    # Module suffixes each engine accepts a LoRA on (read from the engine's own model classes).
    vllm_lora_modules: tuple[str, ...] = LLAMA_LINEARS
    # (config, adapted module paths) -> {module: the module whose LoRA vLLM must apply to it too}: where the model
    # takes one projection's output for two and vLLM computes the two apart (Gemma 4's k_eq_v layers: values = keys)
    vllm_lora_copies: Callable[[dict, Collection[str]], dict[str, str]] | None = None
    # transformers' attention implementation for the reference, where its default computes something else
    reference_attention: str | None = None
    experts: ExpertLayout | None = None  # a mixture-of-experts architecture
    notes: tuple[str, ...] = field(default_factory=tuple)
    # each target's facts; None: the target refuses it (``refusals`` says why)
    gguf: GGUFArch | None = None  # llama.cpp: hyperparameters, config rules, weight folds
    mlx: MlxArch | None = None  # mlx-lm: its model module, config fixes, expert stacking
    awq: AWQArch | None = None  # the calibration pass (AWQ, the GGUF importance matrix): block classes, scale groups
    exl3: bool = False  # exllamav3 converts it
    text_tower: TextTower | None = None  # a multimodal checkpoint: where its text model lies
    # (stored prefix, the model's own): a text model saved under its multimodal parent's names, which readers strip
    stored_prefixes: tuple[tuple[str, str], ...] = ()
    # target -> why it refuses; "expert_lora": why LoRA on the experts is refused where the rest is exported
    refusals: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # (in-memory name suffix, on-disk name suffix): tensors transformers 5 loads under other names than its checkpoints
    # keep (Granite 4's experts: block_sparse_moe.input_linear.weight is experts.gate_up_proj in memory)
    disk_renames: tuple[tuple[str, str], ...] = ()
    vllm_facts: VllmFacts = VllmFacts()  # what vLLM's model class reads elsewhere or hard-codes (``vllm_facts``)
    # config -> the fused linears the GGUF and MLX writers write as separate modules (``convert.split_linears``; the
    # names are what both engines call the parts, or the only writer's that takes them)
    split_linears: Callable[[dict], tuple[SplitLinear, ...]] | None = None

    @property
    def embedding_modules(self) -> tuple[str, ...]:
        return (self.embed.rsplit(".", 1)[-1], self.lm_head.rsplit(".", 1)[-1])


def under_language_model(text: ArchSpec) -> dict:
    """The ArchSpec fields of a multimodal checkpoint that keeps ``text`` under ``model.language_model`` (transformers
    5's layout: Qwen3.5, Gemma 4) with the LM head at the root: its names and the text model's LoRA modules."""
    return {"embed": "model.language_model.embed_tokens", "final_norm": "model.language_model.norm",
            "layer_prefix": "model.language_model.layers", "linear_modules": text.linear_modules,
            "vllm_lora_modules": text.vllm_lora_modules}


def under_hub_language_model(text: ArchSpec) -> dict:
    """The ArchSpec fields of a multimodal checkpoint in the hub's layout, its text model under
    ``language_model.model`` and its LM head at ``language_model.lm_head`` (Gemma 3, Llama 4)."""
    return {"embed": "language_model.model.embed_tokens", "lm_head": "language_model.lm_head",
            "final_norm": "language_model.model.norm", "layer_prefix": "language_model.model.layers",
            "linear_modules": text.linear_modules, "vllm_lora_modules": text.vllm_lora_modules}
