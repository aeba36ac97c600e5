"""The config audit for --target gguf: one case per audited key at a non-default value, each carried into the
GGUF (llama.cpp = transformers), folded, capped, or refused with the reason (exit 2, nothing written)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from tuneport.convert.config_audit import INERT_KEYS, class_default
from tuneport.convert.gguf.config_keys import GGUF_CONFIG_RULES
from tuneport.toolkit.fidelity import compare_logits, llamacpp_logits, llamacpp_model, load_hf, logits
from tuneport.toolkit.tiny import make_base

IDS = [1, 50, 60, 70, 80, 90, 100, 3, 4, 200, 300, 411, 7, 8, 9, 10]
# llama.cpp's fp16 GELU table (tests/test_gguf_export.py); else 1e-4
TOL = {"gemma3_text": 5e-3, "gemma2": 5e-3, "gemma4_text": 3e-2}


@dataclass(frozen=True)
class Case:
    arch: str
    key: str  # the audited key this case gives a non-default value
    overrides: dict  # config values (transformers' names) the tiny model is built with
    expect: str  # "parity" | "capped" | "refused: <a piece of the message>"
    config_patch: dict | None = None  # written into config.json after the build (layouts transformers rewrites)

    @property
    def id(self) -> str:
        return f"{self.arch}-{self.key}"


ROPE = {"rope_theta": 10000.0}
LLAMA3 = {**ROPE, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 8,
                   "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 32 for i in range(16)],
                 "long_factor": [1.0 + i for i in range(16)]}
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": True, "original_max_position_embeddings": 8}
CASES = [
    Case("llama", "rms_norm_eps", {"rms_norm_eps": 1e-2}, "parity"),
    Case("llama", "tie_word_embeddings", {"tie_word_embeddings": True}, "parity"),
    Case("llama", "rope_theta", {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, "parity"),
    Case("llama", "rope_parameters", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 4.0}}, "parity"),
    Case("llama", "rope_parameters llama3", {"rope_parameters": LLAMA3}, "parity"),
    Case("qwen2", "rope_parameters", {"rope_parameters": LLAMA3}, "refused: RoPE types"),
    Case("qwen3", "rope_parameters yarn", {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64}}, "parity"),
    Case("mistral", "rope_scaling", {}, "refused: RoPE types",
         config_patch={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters": None}),
    Case("qwen2", "rope_scaling", {}, "parity", config_patch={  # transformers 4's layout
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 300.0, "rope_parameters": None}),
    Case("llama", "hidden_act", {"hidden_act": "gelu"}, "refused: uses SiLU"),
    Case("llama", "attention_bias", {"attention_bias": True}, "parity"),
    Case("llama", "mlp_bias", {"mlp_bias": True}, "parity"),
    Case("mistral", "sliding_window", {"sliding_window": 8}, "capped"),
    Case("qwen2", "use_sliding_window", {"use_sliding_window": True, "sliding_window": 8,
                                         "max_window_layers": 0}, "capped"),
    Case("qwen3", "layer_types", {"layer_types": ["full_attention", "sliding_attention"],
                                  "use_sliding_window": True, "sliding_window": 8}, "capped"),
    Case("gemma3_text", "hidden_activation", {"hidden_activation": "silu"}, "refused: tanh-GELU"),
    Case("gemma3_text", "query_pre_attn_scalar", {"query_pre_attn_scalar": 100}, "parity"),
    Case("gemma3_text", "sliding_window", {"sliding_window": 8}, "parity"),
    Case("gemma3_text", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]},
         "refused: every 6th layer"),
    Case("gemma3_text", "final_logit_softcapping", {"final_logit_softcapping": 1.5}, "parity"),
    Case("gemma3_text", "attn_logit_softcapping", {"attn_logit_softcapping": 50.0}, "refused: soft-cap"),
    Case("gemma3_text", "use_bidirectional_attention", {"use_bidirectional_attention": True}, "refused: causally"),
    Case("gemma3_text", "attention_bias", {"attention_bias": True}, "refused: no attention biases"),
    Case("gemma3_text", "rope_parameters", {"num_hidden_layers": 6, "sliding_window": 8, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}, "parity"),
    Case("gemma3_text", "rope_local_base_freq", {"num_hidden_layers": 6, "sliding_window": 8}, "parity",
         config_patch={"rope_parameters": None, "rope_theta": 1000.0, "rope_local_base_freq": 50.0,
                       "sliding_window_pattern": 6}),  # transformers 4's layout
    Case("gemma3_text", "sliding_window_pattern", {}, "refused: every 6th layer",
         config_patch={"sliding_window_pattern": 2}),
    Case("gemma2", "query_pre_attn_scalar", {"query_pre_attn_scalar": 100}, "parity"),
    Case("gemma2", "attn_logit_softcapping", {"attn_logit_softcapping": 5.0}, "parity"),
    Case("gemma2", "final_logit_softcapping", {"final_logit_softcapping": None}, "refused: always soft-caps"),
    Case("gemma2", "sliding_window", {"sliding_window": 8}, "parity"),
    Case("gemma2", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]},
         "refused: every 2nd layer"),
    Case("gemma2", "tie_word_embeddings", {}, "refused: reuses token_embd",
         config_patch={"tie_word_embeddings": False}),
    Case("gemma2", "hidden_activation", {"hidden_activation": "silu"}, "refused: tanh-GELU"),
    Case("gemma2", "use_bidirectional_attention", {"use_bidirectional_attention": True}, "refused: causally"),
    Case("gemma2", "attention_bias", {"attention_bias": True}, "refused: no attention biases"),
    Case("phi3", "sliding_window", {"sliding_window": 8}, "capped"),
    # LongRoPE: short factors away from 1 (llama.cpp takes them while its context, at least 256, is at most the
    # original) and the attention factor of 1,024 positions over an original 256
    Case("phi3", "rope_parameters", {"max_position_embeddings": 1024, "rope_parameters": {
        **PHI3_LONGROPE, "original_max_position_embeddings": 256}}, "parity", config_patch={
        "original_max_position_embeddings": 256}),
    Case("phi3", "rope_scaling", {"max_position_embeddings": 1024}, "parity", config_patch={  # as Phi-4-mini ships it
        "rope_scaling": {"type": "longrope", "short_factor": PHI3_LONGROPE["short_factor"],
                         "long_factor": PHI3_LONGROPE["long_factor"]},
        "original_max_position_embeddings": 256, "rope_theta": 10000.0, "rope_parameters": None}),
    Case("phi3", "original_max_position_embeddings", {"max_position_embeddings": 2048}, "parity", config_patch={
        "rope_scaling": {"type": "longrope", "short_factor": PHI3_LONGROPE["short_factor"],
                         "long_factor": PHI3_LONGROPE["long_factor"]},
        "original_max_position_embeddings": 512, "rope_theta": 10000.0, "rope_parameters": None}),
    Case("phi3", "partial_rotary_factor", {"rope_parameters": {**ROPE, "rope_type": "default",
                                                               "partial_rotary_factor": 0.5}}, "parity"),
    Case("olmo2", "attention_bias", {"attention_bias": True}, "refused: no such biases"),
    Case("ministral3", "rope_parameters", {"rope_parameters": {**MINISTRAL3_ROPE, "partial_rotary_factor": 0.5}},
         "refused: rotates the whole head"),
    Case("ministral3", "partial_rotary_factor", {}, "refused: rotates the whole head",
         config_patch={"partial_rotary_factor": 0.5}),
    Case("ministral3", "original_max_position_embeddings", {"rope_parameters": {
        **MINISTRAL3_ROPE, "original_max_position_embeddings": 4}}, "parity"),  # the temperature steps every 4
    Case("seed_oss", "attention_out_bias", {"attention_out_bias": True}, "refused: no output-projection bias"),
    Case("ernie4_5", "use_bias", {"use_bias": True}, "refused: no projection biases"),
    Case("exaone4", "sliding_window", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
         "refused: 64-layer (32B) shape"),
    Case("exaone4", "layer_types", {"layer_types": ["full_attention", "full_attention"]}, "parity"),
    Case("olmo3", "sliding_window", {"sliding_window": 4}, "parity"),
    Case("olmo3", "layer_types", {"layer_types": ["full_attention", "sliding_attention", "full_attention",
                                                  "sliding_attention"]}, "parity"),  # any pattern: one flag a layer
    # Qwen3.5: any layer pattern (one recurrent flag a layer), other linear-attention shapes, the output gate
    Case("qwen3_5_text", "layer_types", {"layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                         "full_attention"]}, "parity"),
    Case("qwen3_5_text", "full_attention_interval", {"layer_types": None, "full_attention_interval": 2}, "parity",
         config_patch={"layer_types": None, "full_attention_interval": 2}),  # the interval alone places them
    Case("qwen3_5_text", "linear_conv_kernel_dim", {"linear_conv_kernel_dim": 3}, "parity"),
    Case("qwen3_5_text", "linear_key_head_dim", {"linear_key_head_dim": 32}, "refused: value head size"),
    Case("qwen3_5_text", "linear_value_head_dim", {"linear_value_head_dim": 32}, "refused: value head size"),
    Case("qwen3_5_text", "linear_num_key_heads", {"linear_num_key_heads": 4}, "parity"),  # grouped = tiled
    Case("qwen3_5_text", "linear_num_value_heads", {"linear_num_value_heads": 8}, "parity"),
    # half the head rotated, over sections that leave llama.cpp's last pair unrotated as written (sections rewritten)
    Case("qwen3_5_text", "partial_rotary_factor", {"rope_parameters": {
        **ROPE, "rope_type": "default", "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2]}}, "parity"),
    Case("qwen3_5_text", "attn_output_gate", {}, "refused: always gate", config_patch={"attn_output_gate": False}),
    Case("qwen3_5_text", "attention_bias", {"attention_bias": True}, "refused: no such biases"),
    Case("qwen3_5_moe_text", "moe_intermediate_size", {"moe_intermediate_size": 96}, "parity"),
    Case("qwen3_5_moe_text", "shared_expert_intermediate_size", {"shared_expert_intermediate_size": 96}, "parity"),
    # gpt-oss: its window on any layers (one flag a layer), another window and original context; what llama.cpp
    # hard-codes (SwiGLU clamp, attention output biases, YaRN rounded) refused
    Case("gpt_oss", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]}, "parity"),
    Case("gpt_oss", "sliding_window", {"sliding_window": 4}, "parity"),
    Case("gpt_oss", "original_max_position_embeddings", {"rope_parameters": {**GPT_OSS_ROPE,
                                                         "original_max_position_embeddings": 4}}, "parity"),
    Case("gpt_oss", "rope_parameters", {"rope_parameters": {**GPT_OSS_ROPE, "truncate": False}},
         "refused: YaRN with truncate: false, which llama.cpp cannot express"),
    Case("gpt_oss", "partial_rotary_factor", {}, "refused: rotates the whole head",
         config_patch={"partial_rotary_factor": 0.5}),
    Case("gpt_oss", "swiglu_limit", {"swiglu_limit": 5.0}, "refused: hard-codes alpha 1.702 and limit 7.0"),
    Case("gpt_oss", "swiglu_alpha", {"swiglu_alpha": 1.5}, "refused: hard-codes alpha 1.702 and limit 7.0"),
    Case("gpt_oss", "attention_bias", {"attention_bias": False}, "refused: requires attention output biases"),
    # LFM2: its eps, conv taps, layer kinds (either key) and MLP width carried; what llama.cpp's graph lacks refused
    Case("lfm2", "norm_eps", {"norm_eps": 1e-2}, "parity"),
    Case("lfm2", "conv_L_cache", {"conv_L_cache": 4}, "parity"),
    Case("lfm2", "layer_types", {"layer_types": ["full_attention", "conv", "conv", "full_attention"]}, "parity"),
    Case("lfm2", "full_attn_idxs", {"layer_types": None, "full_attn_idxs": [1, 3]}, "parity",
         config_patch={"layer_types": None, "full_attn_idxs": [1, 3]}),
    Case("lfm2", "block_ff_dim", {}, "parity", config_patch={"block_ff_dim": 384, "intermediate_size": None}),
    Case("lfm2", "block_ff_dim unadjusted", {"block_auto_adjust_ff_dim": False, "intermediate_size": 192}, "parity"),
    Case("lfm2", "conv_bias", {"conv_bias": True}, "refused: no biases on its convolution blocks"),
    Case("lfm2", "head_dim", {}, "refused: hidden_size / num_attention_heads", config_patch={"head_dim": 64}),
    Case("gemma4_text", "global_head_dim", {"global_head_dim": 32}, "parity",  # the hub's layout
         config_patch={"per_layer_config": None, "global_head_dim": 32}),
    Case("gemma4_text", "per_layer_config", {"global_head_dim": 128}, "parity"),  # transformers 5.19's layout
    Case("gemma4_text", "num_global_key_value_heads", {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
         "parity", config_patch={"per_layer_config": None, "global_head_dim": 64, "num_global_key_value_heads": 1}),
    Case("gemma4_text", "attention_k_eq_v", {"attention_k_eq_v": True}, "parity"),
    Case("gemma4_text", "partial_rotary_factor", {}, "refused: per layer kind",
         config_patch={"partial_rotary_factor": 0.5}),
    Case("gemma4_text", "hidden_activation", {"hidden_activation": "gelu"}, "refused: uses tanh-GELU"),
    Case("gemma4_text", "attention_bias", {"attention_bias": True}, "refused: has no attention biases"),
    Case("gemma4_text", "use_bidirectional_attention", {"use_bidirectional_attention": "all"},
         "refused: runs Gemma 4's text causally"),
    Case("gemma4_text", "sliding_window", {"sliding_window": 4}, "parity"),
    Case("gemma4_text", "layer_types", {"layer_types": ["full_attention"] * 4, "num_kv_shared_layers": 0},
         "refused: at least one sliding-window layer"),
    Case("gemma4_text", "rope_parameters", {"rope_parameters": {
        "sliding_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}, "refused: with default RoPE"),
    Case("gemma4_text", "rope_parameters factor", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20000.0,
                           "factor": 4.0}}}, "parity"),
    Case("gemma4_text", "rope_parameters default", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0}}}, "parity"),
    Case("gemma4_text", "final_logit_softcapping", {"final_logit_softcapping": None}, "parity"),
    Case("gemma4_text", "num_kv_shared_layers", {"num_kv_shared_layers": 1}, "refused: the two layers just before"),
    Case("gemma4_text", "num_kv_shared_layers none", {"num_kv_shared_layers": 0}, "parity"),
    Case("gemma4_text", "use_double_wide_mlp", {"use_double_wide_mlp": False}, "parity"),
    Case("gemma4_text", "hidden_size_per_layer_input", {"hidden_size_per_layer_input": 0}, "parity"),
    Case("gemma4_text", "vocab_size_per_layer_input", {}, "refused: a table of vocab_size rows",
         config_patch={"vocab_size_per_layer_input": 4096}),
    Case("gemma4_text", "enable_moe_block", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                             "moe_intermediate_size": 64}, "refused: not built yet"),
    Case("granite", "mlp_bias", {"mlp_bias": True}, "refused: no such biases"),
    Case("granite", "embedding_multiplier", {"embedding_multiplier": 7.0}, "parity"),
    Case("granite", "residual_multiplier", {"residual_multiplier": 0.2}, "parity"),
    Case("granite", "attention_multiplier", {"attention_multiplier": 0.3}, "parity"),
    Case("granite", "logits_scaling", {"logits_scaling": 0.25}, "parity"),
    Case("smollm3", "no_rope_layers", {"no_rope_layers": [1, 1, 1, 1]}, "refused: every 4th layer"),
    Case("smollm3", "no_rope_layer_interval", {"no_rope_layer_interval": 2}, "refused: every 4th layer"),
    # Llama 4: the widths and the MoE interleaving carried; what llama.cpp's llama4 graph hard-codes refused
    Case("llama4_text", "intermediate_size_mlp", {"intermediate_size_mlp": 192}, "parity"),
    Case("llama4_text", "interleave_moe_layer_step", {"interleave_moe_layer_step": 1}, "parity"),  # Scout's
    Case("llama4_text", "moe_layers", {"moe_layers": [0, 2]}, "refused: multiple of interleave_moe_layer_step"),
    # (patched in after the build: transformers derives layer_types from them, which would be refused first)
    Case("llama4_text", "no_rope_layers", {}, "refused: skips RoPE on every 4th layer",
         config_patch={"no_rope_layers": [1, 1, 0, 1]}),
    Case("llama4_text", "no_rope_layer_interval", {}, "refused: skips RoPE on every 4th",
         config_patch={"no_rope_layer_interval": 2}),
    Case("llama4_text", "layer_types", {"layer_types": ["full_attention"] * 4},
         "refused: chunks attention on the RoPE"),
    Case("llama4_text", "use_qk_norm", {"use_qk_norm": False}, "refused: norms q and k exactly when"),
    Case("llama4_text", "attention_chunk_size", {"attention_chunk_size": 16}, "refused: by 8192 tokens"),
    Case("llama4_text", "attn_temperature_tuning", {"attn_temperature_tuning": False}, "refused: scales the queries"),
    Case("llama4_text", "floor_scale", {"floor_scale": 4}, "refused: scales the queries"),
    Case("llama4_text", "attn_scale", {"attn_scale": 0.2}, "refused: scales the queries"),
    Case("llama4_text", "attention_bias", {"attention_bias": True}, "refused: has no attention biases"),
    # Granite 4: the Mamba-2 sizes and the layer pattern carried, RoPE switched; what llama.cpp's Mamba-2 graph
    # hard-codes refused (the hub's layer names in the file: transformers 5 renames them on load)
    Case("granitemoehybrid", "layer_types", {"layer_types": ["attention", "mamba", "mamba", "attention"]}, "parity",
         config_patch={"layer_types": ["attention", "mamba", "mamba", "attention"]}),
    Case("granitemoehybrid", "position_embedding_type", {"position_embedding_type": "rope"}, "parity"),
    # Granite-4.0-Micro's shape, which llama.cpp runs as a Granite 3 model (granite): with RoPE, as released
    Case("granitemoehybrid", "layer_types without Mamba", {"layer_types": ["attention"] * 4,
                                                           "position_embedding_type": "rope"}, "parity"),
    Case("granitemoehybrid", "layer_types without Mamba or RoPE", {"layer_types": ["attention"] * 4}, "parity"),
    Case("granitemoehybrid", "mamba_n_heads", {"mamba_n_heads": 4, "mamba_d_head": 64}, "parity"),
    Case("granitemoehybrid", "mamba_d_head", {"mamba_n_heads": 16, "mamba_d_head": 16}, "parity"),
    Case("granitemoehybrid", "mamba_d_state", {"mamba_d_state": 32}, "parity"),
    Case("granitemoehybrid", "mamba_d_conv", {"mamba_d_conv": 3}, "parity"),
    Case("granitemoehybrid", "shared_intermediate_size", {"shared_intermediate_size": 192}, "parity"),
    Case("granitemoehybrid", "mamba_expand", {"mamba_expand": 1, "mamba_d_head": 16}, "refused: twice the hidden"),
    Case("granitemoehybrid", "mamba_n_groups", {"mamba_n_groups": 2}, "refused: per group"),
    Case("granitemoehybrid", "mamba_conv_bias", {"mamba_conv_bias": False}, "refused: always adds the convolution"),
    Case("granitemoehybrid", "mamba_proj_bias", {"mamba_proj_bias": True}, "refused: no in_proj / out_proj biases"),
    Case("granitemoehybrid", "time_step_limit", {"time_step_limit": (0.0, 10.0)}, "refused: never clamps"),
    Case("granitemoehybrid", "num_local_experts", {"num_local_experts": 4, "num_experts_per_tok": 2},
         "refused: does not export Granite 4's routed experts yet"),
    Case("mixtral", "num_local_experts", {"num_local_experts": 6}, "parity"),
    Case("mixtral", "num_experts_per_tok", {"num_experts_per_tok": 3}, "parity"),
    Case("qwen3_moe", "num_experts", {"num_experts": 6}, "parity",  # real Qwen3-MoE configs' name
         config_patch={"num_local_experts": None, "num_experts": 6}),
    Case("qwen3_moe", "moe_intermediate_size", {"moe_intermediate_size": 96}, "parity"),
    Case("qwen3_moe", "norm_topk_prob", {"norm_topk_prob": False}, "refused: renormalizes"),
    Case("qwen3_moe", "decoder_sparse_step", {"decoder_sparse_step": 2}, "refused: every Qwen3-MoE layer"),
    Case("qwen3_moe", "mlp_only_layers", {"mlp_only_layers": [1]}, "refused: every Qwen3-MoE layer"),
    Case("qwen2_moe", "qkv_bias", {"qkv_bias": False}, "parity"),  # llama.cpp's q/k/v biases are optional
    Case("qwen2_moe", "moe_intermediate_size", {"moe_intermediate_size": 96}, "parity"),
    Case("qwen2_moe", "shared_expert_intermediate_size", {"shared_expert_intermediate_size": 96}, "parity"),
    Case("qwen2_moe", "norm_topk_prob", {"norm_topk_prob": True}, "refused: does not renormalize"),
    Case("qwen2_moe", "decoder_sparse_step", {"decoder_sparse_step": 2}, "refused: every Qwen2-MoE layer"),
    Case("qwen2_moe", "mlp_only_layers", {"mlp_only_layers": [1]}, "refused: every Qwen2-MoE layer"),
    Case("qwen2_moe", "tie_word_embeddings", {"tie_word_embeddings": True}, "refused: its own output tensor"),
    # a key the file leaves out is what transformers' default makes it, not what the engine assumes
    Case("qwen3_moe", "norm_topk_prob absent", {}, "refused: renormalizes", config_patch={"norm_topk_prob": None}),
    Case("gemma3_text", "query_pre_attn_scalar absent", {}, "parity", config_patch={"query_pre_attn_scalar": None}),
    # a key no rule names: inert when transformers does not read it, refused when what it reads changes
    Case("llama", "unknown key", {}, "parity", config_patch={"attn_temperature": 0.5, "unsloth_version": "2026.4.2"}),
    Case("llama", "read key without a rule", {}, "refused: (attention_chunk_size 2 (without the key: none)), and "
         "tuneport's GGUF writer does not carry it", config_patch={"attention_chunk_size": 2}),
]
# Rules that need no case: shapes and context length (every parity test carries them), and inert keys.
UNTESTED_HOW = {"inert"}
UNTESTED_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "max_window_layers"}


def build(case: Case, root):
    dims = dict(case.overrides)
    base = make_base(case.arch, root / "base", tied=dims.pop("tie_word_embeddings", False), dims=dims)
    if case.config_patch:
        path = base / "config.json"
        cfg = json.loads(path.read_text())
        for k, v in case.config_patch.items():
            cfg.pop(k) if v is None else cfg.__setitem__(k, v)
        path.write_text(json.dumps(cfg, indent=2))
    return base


def test_every_audited_key_has_a_case():
    """A rule (per key and behaviour, shared rules counted once) without a case here fails the suite."""
    covered = {(c.arch, c.key) for c in CASES}
    missing = []
    seen = set()
    for arch, rules in GGUF_CONFIG_RULES.items():
        for key, rule in rules.items():
            if rule.how in UNTESTED_HOW or key in UNTESTED_KEYS or id(rule) in seen:
                continue
            seen.add(id(rule))
            if (arch, key) not in covered and not any(c.key.split()[0] == key and
                                                      GGUF_CONFIG_RULES[c.arch].get(key) is rule for c in CASES):
                missing.append(f"{arch}.{key}")
    assert not missing, f"audited keys without a test case: {missing}"


def test_every_default_key_is_audited_or_inert():
    """Each key transformers writes for an architecture is in its rules or inert: a new transformers key at a
    non-default value would be refused, at its default it passes; this lists what the table does not name."""
    for arch, rules in GGUF_CONFIG_RULES.items():
        from transformers import AutoConfig

        unnamed = [k for k in AutoConfig.for_model(arch).to_dict() if k not in rules and k not in INERT_KEYS]
        assert unnamed == [], f"{arch}: {unnamed}"
        assert class_default(arch, "model_type") == arch


@pytest.mark.llamacpp
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_config_key(case, tmp_path, cli):
    base = build(case, tmp_path)
    out = tmp_path / "gguf"
    code, stdout, err = cli("export", "--target", "gguf", "--json", "--base", base, "--quant", "f32", "--out", out)
    if case.expect.startswith("refused"):
        assert code == 2 and not out.exists(), (code, err)
        assert case.expect.split(": ", 1)[1] in err and "Traceback" not in err, err
        return
    assert code == 0, err
    result = json.loads(stdout)
    ids = IDS
    if case.expect == "capped":
        import gguf

        window = int(case.overrides["sliding_window"])
        reader = gguf.GGUFReader(str(out / f"{base.name}-F32.gguf"))
        field = reader.get_field(f"{reader.get_field('general.architecture').contents()}.context_length")
        assert field.contents() == window
        assert any("sliding window" in n for n in result["notes"]), result["notes"]
        ids = IDS[:window]  # up to the window the sliding and full attentions agree
    ref = logits(load_hf(base), torch.tensor([ids]))[0]
    llm = llamacpp_model(out / f"{base.name}-F32.gguf")
    try:
        cmp = compare_logits(ref, llamacpp_logits(llm, ids))
    finally:
        llm.close()
    print(f"\n{case.id}: max|d| {cmp.max_abs:.2e}")
    assert cmp.max_abs <= TOL.get(case.arch, 1e-4), cmp
