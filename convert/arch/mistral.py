"""Mistral: run by llama.cpp's llama graph and mlx-lm's Llama, neither with a sliding window."""

from ..calibration.layouts import transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, LLAMA_ROPE, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch, no_sliding_window, rope_top_level
from .spec import ArchSpec

ARCH = ArchSpec(
    "mistral",
    ("MistralForCausalLM",),
    gguf_arch="llama",
    rope_style="normal",
    notes=("vLLM: 'We don't support LoRA on the embedding layers' for Mistral",),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, **NO_SLIDING_GRAPH, **LLAMA_ROPE}, write_vocab_size=True,
                  write_rope_dims=True),
    mlx=MlxArch("llama", (rope_top_level, no_sliding_window), notes=("mlx-lm runs Mistral as Llama",)),
    awq=transformers_layout("mistral", "Mistral"),
    exl3=True,
)
