"""Qwen3: per-head q/k norms."""

from ..calibration.layouts import transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import BIASES, COMMON, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch
from .spec import ArchSpec

ARCH = ArchSpec(
    "qwen3",
    ("Qwen3ForCausalLM",),
    gguf_arch="qwen3",
    rope_style="neox",
    notes=("per-head q_norm / k_norm",),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, **NO_SLIDING_GRAPH, "attention_bias": BIASES["attention_bias"]}),
    mlx=MlxArch("qwen3"),
    awq=transformers_layout("qwen3", "Qwen3"),
    exl3=True,
)
