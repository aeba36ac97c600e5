"""Llama 4 (text): a mixture of experts on every ``interleave_moe_layer_step``-th layer (dense SwiGLU MLPs of
``intermediate_size_mlp`` between) whose router picks the top-k logits, weighs each chosen expert's *input* by the
sigmoid of its logit and adds a shared expert always; attention with RoPE on interleaved pairs (no q/k
permutation) chunked by ``attention_chunk_size`` and followed by a weightless RMS norm of q and k, and every 4th
layer without RoPE, attending to everything with a query temperature that grows with the position. Experts are
stored fused ``[E, in, out]``, gate then up (``ExpertLayout.stored_in_out``)."""

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import COMMON_HPARAMS, EXPERTS, GGUFArch
from ..gguf.config_rules import COMMON, LLAMA_ROPE, MOE, layer_pattern
from ..mlx.arch_facts import MlxArch, rope_scaling_key, rope_top_level
from ..vllm_facts import VllmFacts, llama4_temperature
from .spec import LLAMA_LINEARS, ArchSpec, ExpertLayout

GRAPH = "llama.cpp's llama4 graph"
TEMPERATURE = (f"{GRAPH} scales the queries of its layers without RoPE by log1p(floor((pos + 1) / 8192)) * 0.1 + 1 "
               "(hard-coded)")


def rope_layer(i: int) -> int:
    """1 where layer ``i`` rotates q and k (transformers' default no_rope_layers: every 4th layer without)."""
    return int((i + 1) % 4 != 0)


def moe_layers(engine: str):
    """``engine`` makes layer i sparse when (i + 1) is a multiple of interleave_moe_layer_step."""
    def check(value, cfg: dict) -> str | None:
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        if value is None or list(value) == list(range(step - 1, int(cfg["num_hidden_layers"]), step)):
            return None
        return (f"{engine} makes a layer sparse when its number (from 1) is a multiple of interleave_moe_layer_step "
                f"({step}); this model's moe_layers differ: {value}")
    return check


def layer_rules(engine: str) -> dict[str, KeyRule]:
    """What llama.cpp and mlx-lm alike hard-code about Llama 4's layers (no config key changes it)."""
    nope = f"{engine} skips RoPE on every 4th layer (hard-coded)"
    return {
        "moe_layers": KeyRule("refused unless", "every interleave_moe_layer_step-th layer", moe_layers(engine)),
        "no_rope_layers": KeyRule("refused unless", "every 4th layer without RoPE", layer_pattern(
            "no_rope_layers", rope_layer, nope)),
        "no_rope_layer_interval": KeyRule("refused unless", "4", must_be(4, why=nope)),
        "layer_types": KeyRule("refused unless", "chunked attention on the RoPE layers, full on the others",
                               layer_pattern("layer_types", lambda i: "chunked_attention" if rope_layer(i)
                                             else "full_attention", f"{engine} chunks attention on the RoPE "
                                             "layers only")),
    }


def qk_norm(value, cfg: dict) -> str | None:
    """llama.cpp norms q and k on the RoPE layers unless the model has 128 experts (Maverick, which has none)."""
    want = int(cfg.get("num_local_experts") or 0) != 128
    return None if bool(value) == want else (
        f"{GRAPH} norms q and k exactly when the model has other than 128 experts (this one has "
        f"{cfg.get('num_local_experts')}); use_qk_norm {value} differs")


ARCH = ArchSpec(
    "llama4_text",
    ("Llama4ForCausalLM",),
    gguf_arch="llama4",
    rope_style="interleaved",
    # dense layers' MLP and the MoE layers' shared expert: feed_forward.{gate,up,down}_proj and
    # feed_forward.shared_expert.*; the routed experts' projections through ExpertLayout
    linear_modules=LLAMA_LINEARS,
    vllm_lora_modules=LLAMA_LINEARS,
    experts=ExpertLayout("feed_forward", "gate_proj", "up_proj", "down_proj", router="router",
                         memory_block="feed_forward", stored_in_out=True, peft_transposed=True),
    notes=("mixture of experts on every interleave_moe_layer_step-th layer: a sigmoid-weighted top-k router that "
           "scales each chosen expert's input, and a shared expert; dense MLPs between",
           "RoPE on interleaved pairs, chunked attention and a weightless q/k norm; every 4th layer without RoPE, "
           "attending to everything with a position-dependent query temperature",
           "experts stored fused [E, in, out] (gate, then up)"),
    gguf=GGUFArch(tuple(h for h in COMMON_HPARAMS if h[0] != "feed_forward_length") + EXPERTS + (
        ("feed_forward_length", ("intermediate_size_mlp",), "u32"),
        ("expert_feed_forward_length", ("intermediate_size",), "u32"),
        ("interleave_moe_layer_step", ("interleave_moe_layer_step",), "u32"),
    ), {
        **COMMON, **MOE, **LLAMA_ROPE,
        "intermediate_size": KeyRule("carried", "expert_feed_forward_length (the experts' and shared expert's "
                                     "width)"),
        "intermediate_size_mlp": KeyRule("carried", "feed_forward_length (the dense layers' width)"),
        "interleave_moe_layer_step": KeyRule("carried", "interleave_moe_layer_step"),
        **layer_rules(GRAPH),
        "use_qk_norm": KeyRule("refused unless", "true (false with 128 experts)", qk_norm),
        "attention_chunk_size": KeyRule("refused unless", "8192", must_be(
            8192, why=f"{GRAPH} chunks attention by 8192 tokens (hard-coded)")),
        "attn_temperature_tuning": KeyRule("refused unless", "true", must_be(True, why=TEMPERATURE)),
        "floor_scale": KeyRule("refused unless", "8192", must_be(8192, why=TEMPERATURE)),
        "attn_scale": KeyRule("refused unless", "0.1", must_be(0.1, why=TEMPERATURE)),
        "attention_bias": KeyRule("refused unless", "false", must_be(
            False, None, why=f"{GRAPH} has no attention biases")),
    }, write_rope_dims=True),
    # mlx-lm runs the MoE only as its multimodal llama4 (llama4_text there is a dense model)
    mlx=MlxArch("llama4", (rope_top_level, rope_scaling_key), args_class="llama4.TextArgs",
                weight_prefix="language_model.", model_type="llama4", wrapper=True,
                switch_mlp=(("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                switch_block="experts",
                fixed_rules={
                    "num_experts_per_tok": KeyRule("refused unless", "1", must_be(
                        1, why="mlx-lm's llama4 routes each token to one expert")),
                    "tie_word_embeddings": KeyRule("refused unless", "false", must_be(
                        False, None, why="mlx-lm's llama4 always has its own lm_head")),
                    **layer_rules("mlx-lm's llama4")},
                notes=("config nested under text_config and weights under language_model., as mlx-lm's llama4 "
                       "reads them; experts stacked into its SwitchGLU (feed_forward.experts)",)),
    vllm_facts=VllmFacts(generation_fix=llama4_temperature),
    refusals={"awq": "tuneport's AWQ pass has no scale groups for Llama 4's fused, input-weighted experts yet",
              "exl3": "exllamav3 has no architecture for Llama4ForCausalLM"},
)
