"""Granite 4 (``granitemoehybrid``): Mamba-2 layers and attention layers (``layer_types``), each followed by the shared
MLP (``shared_mlp.input_linear``: the gate rows, then the up rows) and, where ``num_local_experts`` is set, routed
experts; Granite's embedding, attention, residual and logit multipliers. The hybrid models (H-Micro, H-1B, H-350M)
run attention without RoPE (``position_embedding_type: "nope"``), the all-attention ones (Granite-4.0-Micro) with it.

A Mamba-2 layer computes ``out_proj(norm(y) · silu(z))`` with ``z | xBC | dt`` the rows of ``in_proj``, ``xBC``
through a depthwise causal convolution of ``mamba_d_conv`` taps (a state of K - 1 inputs per sequence) and a
selective scan over ``mamba_n_heads`` heads (``A_log``, ``D``, ``dt_bias``; a state of ``mamba_d_state`` per head
channel)."""

from ..config_audit import KeyRule, must_be
from ..gguf.arch_facts import GGUFArch
from ..gguf.config_rules import COMMON, NO_BIASES
from ..layer_kinds import granite_hybrid_experts, granite_hybrid_layer_kinds, kv_heads_per_layer
from ..mlx.arch_facts import MlxArch, granite_hybrid_config
from ..vllm_facts import VllmFacts, granite_hybrid_fixed, unclamped
from .granite import MULTIPLIER_HPARAMS, MULTIPLIER_RULES
from .qwen3_5_text import LINEAR_ATTENTION_RULES
from .spec import ATTENTION_LINEARS, ArchSpec, SplitLinear

MAMBA_LINEARS = ("in_proj", "out_proj")
SHARED_MLP_LINEARS = ("input_linear", "output_linear")
LINEARS = ATTENTION_LINEARS + MAMBA_LINEARS + SHARED_MLP_LINEARS
# the shared MLP as the engines keep it apart in a model without experts (llama.cpp's ffn_gate / ffn_up / ffn_down,
# mlx-lm's mlp.gate_proj / up_proj / down_proj)
DENSE_MLP = (SplitLinear("shared_mlp.input_linear", ("mlp.gate_proj", "mlp.up_proj")),
             SplitLinear("shared_mlp.output_linear", ("mlp.down_proj",)))
EXPERTS_NOT_BUILT = ("tuneport's GGUF writer does not export Granite 4's routed experts yet (H-Tiny, H-Small: merge, "
                     "MLX and vLLM do); the models without experts (H-Micro, H-1B, H-350M, Micro) export")


# the routed experts as mlx-lm keeps them (its SwitchGLU: switch_mlp.{gate,up,down}_proj [E, out, in]); the shared
# MLP stays fused beside them, as mlx-lm's MoE layers keep it (GGUF refuses the experts: not built yet)
ROUTED_EXPERTS = (SplitLinear("block_sparse_moe.input_linear", ("block_sparse_moe.switch_mlp.gate_proj",
                                                                "block_sparse_moe.switch_mlp.up_proj")),
                  SplitLinear("block_sparse_moe.output_linear", ("block_sparse_moe.switch_mlp.down_proj",)))


def _split_linears(cfg: dict) -> tuple[SplitLinear, ...]:
    return ROUTED_EXPERTS if granite_hybrid_experts(cfg) else DENSE_MLP


def _gguf_hparams(cfg: dict) -> dict[str, object]:
    """llama.cpp's converter: one KV-head count per layer (0 marks a Mamba layer, which llama.cpp makes recurrent),
    the shared MLP's width as the dense one, no experts, and RoPE switched by ``rope.scaling.finetuned`` (llama.cpp
    applies it when the key is missing)."""
    return {"attention.head_count_kv": kv_heads_per_layer(cfg, granite_hybrid_layer_kinds(cfg), "mamba"),
            "feed_forward_length": int(cfg["shared_intermediate_size"]), "expert_count": 0, "expert_used_count": 0,
            "rope.scaling.finetuned": cfg.get("position_embedding_type") == "rope"}


def _kinds(value, cfg: dict) -> str | None:
    kinds = set(granite_hybrid_layer_kinds(cfg))
    if not kinds <= {"mamba", "attention"}:
        return f"layer types {sorted(kinds)}"
    return None


def _devolve(cfg: dict) -> tuple[str, dict] | None:
    """A Granite 4 without Mamba layers (Granite-4.0-Micro) as llama.cpp's converter writes it: a Granite 3 model
    (``granite``), the shared MLP its MLP. llama.cpp's granitehybrid graph aborts loading it (an empty recurrent
    state: GGML_ASSERT(buffer))."""
    if "mamba" in granite_hybrid_layer_kinds(cfg):
        return None
    return "granite", {**cfg, "intermediate_size": cfg["shared_intermediate_size"]}


def _positions(value, cfg: dict) -> str | None:
    return None if value in ("rope", "nope", None) else f"position_embedding_type {value!r} (rope or nope)"


def _unclamped(value, cfg: dict) -> str | None:
    """transformers clamps the step size to ``time_step_limit`` in its chunked scan (not in its one-token step);
    llama.cpp never clamps: only (0, inf) computes the same."""
    return None if unclamped(value) else f"llama.cpp never clamps the Mamba step size; this model clamps it to {value}"


MAMBA_RULES = {
    "layer_types": KeyRule("carried", "attention.head_count_kv per layer (0 for a Mamba layer)", _kinds),
    "position_embedding_type": KeyRule("carried", "rope.scaling.finetuned (RoPE on the attention layers or none)",
                                       _positions),
    "mamba_n_heads": KeyRule("carried", "ssm.time_step_rank"),
    "mamba_d_head": KeyRule("carried", "ssm.inner_size / ssm.time_step_rank (transformers checks the product)"),
    "mamba_d_state": KeyRule("carried", "ssm.state_size"),
    "mamba_d_conv": KeyRule("carried", "ssm.conv_kernel"),
    "mamba_expand": KeyRule("refused unless", "2", must_be(
        2, why="llama.cpp's granitehybrid graph asserts an inner size of twice the hidden size")),
    "mamba_n_groups": KeyRule("refused unless", "1", must_be(
        1, why="transformers normalizes the gated output over the whole inner size, llama.cpp per group")),
    "mamba_conv_bias": KeyRule("refused unless", "true", must_be(
        True, why="llama.cpp's Mamba-2 graph always adds the convolution's bias")),
    "mamba_proj_bias": KeyRule("refused unless", "false", must_be(
        False, why="llama.cpp's Mamba-2 graph has no in_proj / out_proj biases")),
    "time_step_limit": KeyRule("refused unless", "(0, inf)", _unclamped),
    "mamba_chunk_size": KeyRule("inert", "the block size of transformers' chunked scan: the same sums"),
    "number_of_conv_states": LINEAR_ATTENTION_RULES["number_of_conv_states"],
    "shared_intermediate_size": KeyRule("carried", "feed_forward_length (the shared MLP is the dense one)"),
    "num_local_experts": KeyRule("refused unless", "0", must_be(0, why=EXPERTS_NOT_BUILT)),
    "num_experts_per_tok": KeyRule("inert", "read only with routed experts (num_local_experts, refused above 0)"),
    "router_aux_loss_coef": KeyRule("inert", "a training loss"),
    "output_router_logits": KeyRule("inert", "returns the router's logits for that loss"),
}

ARCH = ArchSpec(
    "granitemoehybrid",
    ("GraniteMoeHybridForCausalLM",),
    gguf_arch="granitehybrid",
    rope_style="normal",
    linear_modules=LINEARS,
    vllm_lora_modules=LINEARS,
    split_linears=_split_linears,
    notes=("Mamba-2 and attention layers (a conv state of mamba_d_conv - 1 inputs and a scan state per sequence), "
           "each followed by the shared MLP; LoRA on every projection (not the conv's taps, A_log, D or dt_bias, "
           "which llama.cpp cannot adapt)",
           "Granite's embedding, attention, residual and logit multipliers (GGUF scales); attention without RoPE in "
           "the hybrid models",
           "GGUF and MLX: the shared MLP's input_linear written as gate and up projections; GGUF: a model without "
           "Mamba layers (Granite-4.0-Micro) written as llama.cpp's granite graph, as its converter does",
           "routed experts (H-Tiny, H-Small): merge, MLX (mlx-lm's switch_mlp) and vLLM merged; GGUF and LoRA on "
           "the experts not built yet"),
    gguf=GGUFArch((
        ("context_length", ("max_position_embeddings",), "u32"),
        ("embedding_length", ("hidden_size",), "u32"),
        ("attention.head_count", ("num_attention_heads",), "u32"),
        ("attention.layer_norm_rms_epsilon", ("rms_norm_eps",), "f32"),
    ) + MULTIPLIER_HPARAMS, {
        **COMMON, "attention_bias": NO_BIASES["attention_bias"], **MULTIPLIER_RULES, **MAMBA_RULES,
        "intermediate_size": KeyRule("inert", "the experts' width: a model without experts does not read it"),
    }, mamba2=True, devolve=_devolve, write_vocab_size=True, write_rope_dims=True, keep_f32=("ssm_conv1d.weight",),
        squeezed=("mamba.conv1d.weight",), derived_hparams=_gguf_hparams,
        no_lora=(("ssm_conv1d.weight", "its convolution (ggml_ssm_conv) takes no LoRA"),)),
    # mlx_lm.models.granitemoehybrid.Model.quant_predicate: the router at 8 bits
    mlx=MlxArch("granitemoehybrid", (granite_hybrid_config,),
                quant_predicate=lambda path: {"group_size": 64, "bits": 8} if path.endswith("router.layer") else None,
                fixed_rules={"layer_types": KeyRule("carried", "as mlx-lm's names (mamba, attention)"),
                             "position_embedding_type": KeyRule("carried", "written out (mlx-lm's default is rope)"),
                             "time_step_limit": KeyRule("carried", "written out (mlx-lm's default clamps)"),
                             "intermediate_size": KeyRule("carried", "the shared MLP's width, mlx-lm's dense MLP")}),
    # transformers 5's names for the routed experts and router (granitemoe's conversion mapping) -> the checkpoints'
    disk_renames=(("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
                  ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
                  ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight")),
    vllm_facts=VllmFacts(config_check=granite_hybrid_fixed),
    refusals={"awq": "tuneport's AWQ pass has no scale groups for Mamba-2 layers yet",
              "exl3": "not built yet for Mamba-2 layers",
              "expert_lora": "tuneport does not read LoRA on Granite 4's routed experts (H-Tiny, H-Small) yet"},
)
