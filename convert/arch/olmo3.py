"""OLMo 3: OLMo 2's layers (norms after attention and MLP, q/k norms over all heads) with a sliding window on the
layers ``layer_types`` marks (3 of every 4 in the released models), YaRN on the full-attention layers only.
llama.cpp runs it with its OLMo 2 graph, which reads the per-layer window pattern (as its own converter writes)."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES, attention_layer_types
from ..mlx.arch_facts import MlxArch, olmo3_rope
from .olmo2 import OLMO2_GROUPS
from .spec import ArchSpec

LAYER_TYPES = KeyRule("carried", "attention.sliding_window_pattern (one flag per layer)", attention_layer_types)

ARCH = ArchSpec(
    "olmo3",
    ("Olmo3ForCausalLM",),
    gguf_arch="olmo2",
    rope_style="neox",
    notes=("norms after attention and MLP (no input norm); q/k norms over all heads",
           "sliding-window layers (layer_types); YaRN on the full-attention layers only"),
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING, {
        **COMMON, "attention_bias": NO_BIASES["attention_bias"],
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": LAYER_TYPES,
    }, write_freq_base_swa=True, write_swa_pattern=True),
    mlx=MlxArch("olmo3", (olmo3_rope,), fixed_rules={"layer_types": KeyRule("carried", "as is")}),
    awq=transformers_layout("olmo3", "Olmo3", OLMO2_GROUPS),
    exl3=True,
)
