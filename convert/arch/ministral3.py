"""Ministral 3 (the text model of Ministral 3 / Devstral Small 2): Mistral's layers with YaRN and Llama 4's
attention temperature (queries scaled by 1 + beta * log(1 + floor(position / original context))), which
llama.cpp's mistral3 graph computes the same way (offset 0) from ``attention.temperature_scale``."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_SLIDING_GRAPH, ROPE_TYPES, rope_check
from ..mlx.arch_facts import MlxArch
from ..vllm_facts import VllmFacts, llama_4_scaling
from .spec import ArchSpec

WHOLE_HEAD = "transformers' Ministral 3 rotates the whole head (a partial rotary factor fails in its attention)"


def ministral3_rope(value, cfg: dict) -> str | None:
    """RoPE types llama.cpp runs, over the whole head."""
    if (why := rope_check(*ROPE_TYPES)(value, cfg)) is not None:
        return why
    return WHOLE_HEAD if isinstance(value, dict) and value.get("partial_rotary_factor", 1) not in (1, 1.0) else None


ARCH = ArchSpec(
    "ministral3",
    ("Ministral3ForCausalLM",),
    gguf_arch="mistral3",
    rope_style="normal",
    notes=("YaRN; queries scaled by Llama 4's attention temperature past the original context",),
    gguf=GGUFArch(COMMON_HPARAMS, {
        **COMMON, **NO_SLIDING_GRAPH,
        "rope_parameters": KeyRule("carried", "rope.freq_base, rope.scaling.* (yarn: betas, log multiplier) and "
                                   "attention.temperature_scale", ministral3_rope),
        # what transformers' YaRN reads, from rope_parameters
        "partial_rotary_factor": KeyRule("refused unless", "1", must_be(1, 1.0, None, why=WHOLE_HEAD)),
        "original_max_position_embeddings": KeyRule("carried", "rope.scaling.original_context_length, and the "
                                                    "attention temperature's step (llama.cpp: n_ctx_orig_yarn)"),
        "default_rope_type": KeyRule("inert", "the config class's own default, not a config.json key"),
    }, write_vocab_size=True, write_rope_dims=True,
                  rope_hparams=(("rope.scaling.yarn_beta_fast", ("beta_fast",), "f32"),
                                ("rope.scaling.yarn_beta_slow", ("beta_slow",), "f32"),
                                ("rope.scaling.yarn_log_multiplier", ("mscale_all_dim",), "f32"),
                                ("attention.temperature_scale", ("llama_4_scaling_beta",), "f32"))),
    mlx=MlxArch("ministral3", (), notes=("mlx-lm's ministral3 reads rope_parameters as transformers 5 writes it",)),
    awq=transformers_layout("ministral3", "Ministral3"),
    exl3=True,
    vllm_facts=VllmFacts(config_fix=llama_4_scaling),
)
