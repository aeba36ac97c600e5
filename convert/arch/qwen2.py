"""Qwen2 / Qwen2.5: biased q/k/v, NeoX RoPE."""

from ..calibration.layouts import transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch
from .spec import ArchSpec

ARCH = ArchSpec(
    "qwen2",
    ("Qwen2ForCausalLM",),
    gguf_arch="qwen2",
    rope_style="neox",
    notes=("q/k/v projections carry biases",),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, **NO_SLIDING_GRAPH}),
    mlx=MlxArch("qwen2"),
    awq=transformers_layout("qwen2", "Qwen2"),
    exl3=True,
)
