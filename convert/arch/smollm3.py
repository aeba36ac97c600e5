"""SmolLM3: every 4th layer without RoPE."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES, NO_SLIDING_GRAPH, layer_pattern
from ..mlx.arch_facts import MlxArch, no_sliding_window, rope_top_level
from .spec import ArchSpec

ARCH = ArchSpec(
    "smollm3",
    ("SmolLM3ForCausalLM",),
    gguf_arch="smollm3",
    rope_style="normal",
    notes=("every 4th layer without RoPE (no_rope_layers)",),
    gguf=GGUFArch(COMMON_HPARAMS, {
        **COMMON, **NO_SLIDING_GRAPH, **NO_BIASES,
        "no_rope_layers": KeyRule("refused unless", "every 4th layer without RoPE", layer_pattern(
            "no_rope_layers", lambda i: int((i + 1) % 4 != 0),
            "llama.cpp skips RoPE on every 4th layer (n_no_rope_layer_step 4, no GGUF key)")),
        "no_rope_layer_interval": KeyRule("refused unless", "4", must_be(
            4, why="llama.cpp skips RoPE on every 4th layer (n_no_rope_layer_step 4, no GGUF key)")),
    }, write_vocab_size=True, write_rope_dims=True),
    mlx=MlxArch("smollm3", (rope_top_level, no_sliding_window)),
    awq=transformers_layout("smollm3", "SmolLM3"),
    exl3=True,
)
