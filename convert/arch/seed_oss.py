"""Seed-OSS: Llama's layers with biased q/k/v (``attention_bias``), an unbiased output projection
(``attention_out_bias``), NeoX RoPE."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import BIASES, COMMON, NO_BIASES
from ..mlx.arch_facts import MlxArch, rope_top_level
from .spec import ArchSpec

ARCH = ArchSpec(
    "seed_oss",
    ("SeedOssForCausalLM",),
    gguf_arch="seed_oss",
    rope_style="neox",
    notes=("q/k/v projections carry biases",),
    gguf=GGUFArch(COMMON_HPARAMS, {
        **COMMON, "attention_bias": BIASES["attention_bias"], "mlp_bias": NO_BIASES["mlp_bias"],
        "attention_out_bias": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp's Seed-OSS graph has no output-projection bias")),
        "residual_dropout": KeyRule("inert", "applied in training only"),
    }),
    mlx=MlxArch("seed_oss", (rope_top_level,)),
    awq=transformers_layout("seed_oss", "SeedOss"),
    exl3=True,
)
