"""gpt-oss (OpenAI's open-weight MoE): biased attention with a learned sink logit per head, every other layer a
128-token sliding window, YaRN (untruncated), and a routed mixture of experts (softmax over the top-k router logits)
whose experts carry biases and a clamped SwiGLU (``(clamp(up, ±7) + 1) · g · sigmoid(1.702 g)``, ``g = min(gate,
7)``). Its experts are stored fused (``ExpertLayout.stored_in_out``, gate and up interleaved), as released in MXFP4."""

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, MOE, YARN_READS, attention_layer_types
from ..mlx.arch_facts import MlxArch, rope_top_level
from ..vllm_facts import VllmFacts, gpt_oss_fixed
from .spec import ATTENTION_LINEARS, ArchSpec, ExpertLayout


def swiglu_rules(engine: str) -> dict[str, KeyRule]:
    """The SwiGLU clamp ``engine`` hard-codes (alpha 1.702, limit 7.0): other values refused."""
    why = f"{engine} hard-codes alpha 1.702 and limit 7.0"
    return {"swiglu_limit": KeyRule("refused unless", "7.0", must_be(7.0, 7, why=why)),
            "swiglu_alpha": KeyRule("refused unless", "1.702", must_be(1.702, why=why))}



ARCH = ArchSpec(
    "gpt_oss",
    ("GptOssForCausalLM",),
    gguf_arch="gpt-oss",
    rope_style="neox",
    linear_modules=ATTENTION_LINEARS,  # the experts' projections through ExpertLayout
    vllm_lora_modules=ATTENTION_LINEARS,
    reference_attention="eager",  # transformers' sdpa does not take the sinks (it refuses to load)
    experts=ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", router="router", stored_in_out=True,
                         interleaved_gate_up=True),
    notes=("attention sinks (a learned logit per head); every other layer a sliding window; YaRN",
           "mixture of experts with biased experts and a clamped SwiGLU, stored fused (gate and up interleaved); "
           "MXFP4 experts read exactly as the bfloat16 values they decode to"),
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING + EXPERTS + (("expert_feed_forward_length", ("intermediate_size",), "u32"),),
                  {
        **COMMON, **MOE, **YARN_READS,
        "sliding_window": KeyRule("carried", "attention.sliding_window"),
        "layer_types": KeyRule("carried", "attention.sliding_window_pattern (one flag per layer)",
                               attention_layer_types),
        "hidden_act": KeyRule("inert", "gpt-oss's experts compute their own clamped SwiGLU, whatever it says"),
        "attention_bias": KeyRule("refused unless", "true", must_be(
            True, why="llama.cpp's gpt-oss graph requires attention output biases")),
        **swiglu_rules("llama.cpp's gpt-oss graph (LLM_FFN_SWIGLU_OAI_MOE)"),
    }, write_swa_pattern=True, weight_suffixed=("attn_sinks",)),
    # mlx-lm's gpt_oss: experts stacked into SwitchGLU ``mlp.experts`` (biases too), the router at 8 bits
    mlx=MlxArch("gpt_oss", (rope_top_level,), switch_mlp=(("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                                                          ("down_proj", "down_proj")),
                switch_block="experts",
                quant_predicate=lambda path: {"group_size": 64, "bits": 8} if path.endswith("mlp.router") else None,
                fixed_rules={**swiglu_rules("mlx-lm's gpt_oss (SwigluOAI)"),
                             "attention_bias": KeyRule("refused unless", "true", must_be(
                                 True, why="mlx-lm's gpt_oss always adds attention biases"))},
                notes=("experts stacked into mlx-lm's SwitchGLU (mlp.experts), biases included",)),
    vllm_facts=VllmFacts(config_check=gpt_oss_fixed),
    refusals={"awq": "tuneport's AWQ pass has no scale groups for gpt-oss's fused, biased experts yet",
              "exl3": "not built yet: exllamav3's gpt_oss reads the experts fused as transformers holds them (gate "
                      "and up interleaved), tuneport's EXL3 writer quantizes one linear per expert (CUDA only)"},
)
