"""Ministral 3 (the text model of Ministral 3 / Devstral Small 2): Mistral's layers with YaRN and Llama 4's
attention temperature (queries scaled by 1 + beta * log(1 + floor(position / original context))), which
llama.cpp's mistral3 graph computes the same way (offset 0) from ``attention.temperature_scale``."""

from ..calibration.layouts import transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_SLIDING_GRAPH
from ..mlx.arch_facts import MlxArch
from .spec import ArchSpec

ARCH = ArchSpec(
    "ministral3",
    ("Ministral3ForCausalLM",),
    gguf_arch="mistral3",
    rope_style="normal",
    notes=("YaRN; queries scaled by Llama 4's attention temperature past the original context",),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, **NO_SLIDING_GRAPH}, write_vocab_size=True, write_rope_dims=True,
                  rope_hparams=(("rope.scaling.yarn_beta_fast", ("beta_fast",), "f32"),
                                ("rope.scaling.yarn_beta_slow", ("beta_slow",), "f32"),
                                ("rope.scaling.yarn_log_multiplier", ("mscale_all_dim",), "f32"),
                                ("attention.temperature_scale", ("llama_4_scaling_beta",), "f32"))),
    mlx=MlxArch("ministral3", (), notes=("mlx-lm's ministral3 reads rope_parameters as transformers 5 writes it",)),
    awq=transformers_layout("ministral3", "Ministral3"),
    exl3=True,
)
