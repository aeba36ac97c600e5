"""OLMo 2: norms after attention and MLP (no input norm), q/k norms over all heads."""

from ..calibration.layouts import ScaleGroup, transformers_layout
from ..gguf.arch_facts import COMMON_HPARAMS, GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES
from ..mlx.arch_facts import MlxArch
from .spec import ArchSpec

# the norms follow attention and MLP: nothing to fold q/k/v's or gate/up's AWQ scales into
OLMO2_GROUPS = (
    ScaleGroup(None, "none", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ScaleGroup("self_attn.v_proj", "linear", ("self_attn.o_proj",)),
    ScaleGroup(None, "none", ("mlp.gate_proj", "mlp.up_proj")),
    ScaleGroup("mlp.up_proj", "linear", ("mlp.down_proj",)),
)

ARCH = ArchSpec(
    "olmo2",
    ("Olmo2ForCausalLM",),
    gguf_arch="olmo2",
    rope_style="neox",
    notes=("norms after attention and MLP (no input norm); q/k norms over all heads",),
    gguf=GGUFArch(COMMON_HPARAMS, {**COMMON, "attention_bias": NO_BIASES["attention_bias"]}),
    mlx=MlxArch("olmo2"),
    awq=transformers_layout("olmo2", "Olmo2", OLMO2_GROUPS),
    refusals={"exl3": "exllamav3 has no architecture for Olmo2ForCausalLM (it has Olmo3's)"},
)
