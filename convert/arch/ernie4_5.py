"""ERNIE 4.5 (dense): Llama's layers with RoPE rotating interleaved pairs (GPT-J style), as llama.cpp's NORM RoPE
does, so q/k rows are written as they are (no permutation)."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON
from ..mlx.arch_facts import MlxArch, rope_top_level
from .spec import ArchSpec

ARCH = ArchSpec(
    "ernie4_5",
    ("Ernie4_5ForCausalLM",),
    gguf_arch="ernie4_5",
    rope_style="interleaved",
    notes=("RoPE on interleaved pairs (no q/k permutation)",),
    gguf=GGUFArch(COMMON_HPARAMS, {
        **COMMON,
        "use_bias": KeyRule("refused unless", "false", must_be(
            False, None, why="llama.cpp's ERNIE 4.5 graph has no projection biases")),
    }),
    mlx=MlxArch("ernie4_5", (rope_top_level,)),
    awq=transformers_layout("ernie4_5", "Ernie4_5"),
    exl3=True,
)
