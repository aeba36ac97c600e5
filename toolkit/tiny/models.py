"""Deterministic tiny base models for several architectures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizers import TOKENIZER_WRITERS


@dataclass(frozen=True)
class TinyArch:
    """How to build a tiny model of one architecture."""

    model_type: str
    config_class: str
    tokenizer: str  # key of TOKENIZER_WRITERS
    extra: tuple[tuple[str, object], ...] = ()
    always_tied: bool = False  # real checkpoints are all tied (and llama.cpp needs it)
    text_config_class: str | None = None  # multimodal: the text model's config class (a tiny vision tower too)


QWEN3_5_TEXT = (
    ("num_hidden_layers", 4), ("head_dim", 32), ("linear_num_key_heads", 2), ("linear_num_value_heads", 4),
    ("linear_key_head_dim", 64), ("linear_value_head_dim", 64),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}))

# Gemma 4's vision tower, tiny (head size 32, 8-pixel patches)
GEMMA4_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "head_dim": 32, "patch_size": 8, "position_embedding_size": 64}
# Qwen3.5's vision tower, tiny (out_hidden_size: the text model's hidden size)
QWEN3_5_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 8,
                  "num_position_embeddings": 16}
QWEN3_5_MOE_TEXT = (*QWEN3_5_TEXT, ("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64),
                    ("shared_expert_intermediate_size", 64))

GEMMA4_TEXT = (
    ("num_hidden_layers", 4), ("head_dim", 32), ("global_head_dim", 64), ("sliding_window", 8),
    ("layer_types", ["sliding_attention", "full_attention"] * 2), ("num_kv_shared_layers", 2),
    ("hidden_size_per_layer_input", 16), ("use_double_wide_mlp", True), ("final_logit_softcapping", 30.0),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}}))

LLAMA4_TEXT = (
    ("num_hidden_layers", 4), ("head_dim", 32), ("num_local_experts", 4), ("num_experts_per_tok", 1),
    ("intermediate_size", 64), ("intermediate_size_mlp", 256), ("interleave_moe_layer_step", 2),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
# Llama 4's vision tower, tiny (head size 32, 8-pixel patches; its output projected to the text model's width)
LLAMA4_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "image_size": 32, "patch_size": 8, "vision_output_dim": 64, "projector_input_dim": 64,
                 "projector_output_dim": 64}

TINY_ARCHS: dict[str, TinyArch] = {
    "llama": TinyArch("llama", "LlamaConfig", "sentencepiece"),
    "mistral": TinyArch("mistral", "MistralConfig", "sentencepiece", (("sliding_window", None),)),
    "qwen2": TinyArch("qwen2", "Qwen2Config", "bpe", (("use_sliding_window", False),)),
    "qwen3": TinyArch("qwen3", "Qwen3Config", "bpe", (("use_sliding_window", False), ("head_dim", 32))),
    # query_pre_attn_scalar stays at transformers' 256 (head size 32), as in real checkpoints: every
    # target must honour it (the GGUF export folds it into attn_q_norm).
    "gemma3_text": TinyArch("gemma3_text", "Gemma3TextConfig", "sentencepiece",
                            (("head_dim", 32), ("sliding_window", 64))),
    "phi3": TinyArch("phi3", "Phi3Config", "sentencepiece", (("sliding_window", None),)),
    # transformers' defaults otherwise: query_pre_attn_scalar 256, soft-caps 50 (attention) and 30 (final)
    "gemma2": TinyArch("gemma2", "Gemma2Config", "sentencepiece", (("head_dim", 32), ("sliding_window", 64)),
                       always_tied=True),
    # Gemma 3 4B-27B: Gemma3ForConditionalGeneration, the text model above plus a tiny SigLIP vision tower
    "gemma3": TinyArch("gemma3", "Gemma3Config", "sentencepiece", (("head_dim", 32), ("sliding_window", 64)),
                       always_tied=True, text_config_class="Gemma3TextConfig"),
    "olmo2": TinyArch("olmo2", "Olmo2Config", "bpe"),
    # EXAONE-4.0-1.2B's shape: every layer global with RoPE (no window; transformers 5.19 needs layer_types then)
    "exaone4": TinyArch("exaone4", "Exaone4Config", "bpe", (("sliding_window", None), ("head_dim", 32),
                                                             ("layer_types", ["full_attention"] * 2))),
    # ERNIE-4.5-0.3B's choices: tied embeddings, no biases, head_dim set apart
    "ernie4_5": TinyArch("ernie4_5", "Ernie4_5Config", "bpe", (("head_dim", 32), ("use_bias", False))),
    # Seed-OSS-36B's choices: biased q/k/v, head_dim set apart from hidden / heads
    "seed_oss": TinyArch("seed_oss", "SeedOssConfig", "bpe", (("head_dim", 32), ("attention_bias", True),
                                                               ("attention_out_bias", False))),
    # Ministral-3-8B's RoPE (YaRN factor 16, mscale 1, Llama 4 temperature 0.1) over an original context of 8
    # positions, so the tests' sequences cross the temperature's first step
    "ministral3": TinyArch("ministral3", "Ministral3Config", "sentencepiece", (
        ("sliding_window", None), ("head_dim", 32),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                             "original_max_position_embeddings": 8, "max_position_embeddings": 256,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.1}))),
    # 4 layers, 3 sliding (window 8, shorter than the tests' sequences) and 1 full, as Olmo-3-7B's pattern;
    # YaRN on the full layer as the released models (factor 8 over 32 positions)
    "olmo3": TinyArch("olmo3", "Olmo3Config", "bpe", (
        ("num_hidden_layers", 4), ("sliding_window", 8),
        ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "attention_factor": 1.2079441541679836},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))),
    # Qwen3.5-9B's pattern in 4 layers (3 Gated DeltaNet, 1 full attention), 2 key heads and 4 value heads so that
    # llama.cpp's value-head order differs from transformers'; linear head size 64, the smallest vLLM's CPU kernel
    # takes; partial RoPE on a quarter of each head, M-RoPE sections sized to it (text makes them plain)
    "qwen3_5_text": TinyArch("qwen3_5_text", "Qwen3_5TextConfig", "bpe", QWEN3_5_TEXT),
    # Qwen3.5 as released (Qwen3_5ForConditionalGeneration): the text model above and a tiny vision tower
    "qwen3_5": TinyArch("qwen3_5", "Qwen3_5Config", "bpe", QWEN3_5_TEXT, text_config_class="Qwen3_5TextConfig"),
    # Qwen3.6-35B-A3B's choices in Qwen3.5's 4-layer shape: 4 experts, 2 per token, a shared expert
    "qwen3_5_moe_text": TinyArch("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "bpe", QWEN3_5_MOE_TEXT),
    "qwen3_5_moe": TinyArch("qwen3_5_moe", "Qwen3_5MoeConfig", "bpe", QWEN3_5_MOE_TEXT,
                            text_config_class="Qwen3_5MoeTextConfig"),
    # multipliers away from 1, as in real Granite checkpoints (Granite 3: 12, 0.22, 0.0078125, 8)
    "granite": TinyArch("granite", "GraniteConfig", "sentencepiece", (
        ("embedding_multiplier", 3.0), ("residual_multiplier", 0.5), ("attention_multiplier", 0.05),
        ("logits_scaling", 2.0))),
    # 4 layers: the 4th runs without RoPE (no_rope_layer_interval 4)
    "smollm3": TinyArch("smollm3", "SmolLM3Config", "bpe", (("num_hidden_layers", 4),)),
    # 4 experts, 2 per token (Mixtral 8x7B: 8 and 2)
    "mixtral": TinyArch("mixtral", "MixtralConfig", "sentencepiece", (
        ("sliding_window", None), ("num_local_experts", 4), ("num_experts_per_tok", 2))),
    # Qwen3-30B-A3B's choices: top-k weights renormalized, every layer sparse, experts narrower than the MLP
    "qwen3_moe": TinyArch("qwen3_moe", "Qwen3MoeConfig", "bpe", (
        ("use_sliding_window", False), ("head_dim", 32), ("num_experts", 4), ("num_experts_per_tok", 2),
        ("moe_intermediate_size", 64), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
        ("mlp_only_layers", []))),
    # gpt-oss-20b's choices in 2 layers (sliding, full; window 8, shorter than the tests' sequences): 4 experts, 2
    # per token, biased attention with sinks, YaRN factor 32 over an original context of 8 positions, RMSNorm eps
    # 1e-5 (vLLM's gpt-oss hard-codes it). truncate true
    # (llama.cpp's rounding): the released truncate false is refused for GGUF (accepted in test_real_configs)
    "gpt_oss": TinyArch("gpt_oss", "GptOssConfig", "bpe", (
        ("head_dim", 32), ("num_local_experts", 4), ("num_experts_per_tok", 2), ("intermediate_size", 64),
        ("rms_norm_eps", 1e-5),
        ("sliding_window", 8), ("layer_types", ["sliding_attention", "full_attention"]),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 8}))),
    # LFM2-1.2B's pattern in 4 layers (conv, conv, attention, conv), its 3-tap convolution; intermediate_size 384,
    # which the auto-adjusted MLP makes 256 wide; tied, as every LFM2 (mlx-lm and vLLM only run it tied)
    "lfm2": TinyArch("lfm2", "Lfm2Config", "bpe", (
        ("num_hidden_layers", 4), ("intermediate_size", 384),
        ("layer_types", ["conv", "conv", "full_attention", "conv"])), always_tied=True),
    # Gemma 4 E2B's choices in 4 layers (sliding, full, sliding, full; window 8): per-layer embeddings (PLE), the
    # last 2 layers reusing the KV of the last earlier layer of their kind with double-wide MLPs, full layers with
    # their own head size (64) and proportional RoPE on a quarter of it, soft-capped logits; layer_scalar away from 1
    "gemma4_text": TinyArch("gemma4_text", "Gemma4TextConfig", "sentencepiece", GEMMA4_TEXT),
    # Gemma 4 as released (Gemma4ForConditionalGeneration): the text model above and a tiny vision tower, tied
    "gemma4": TinyArch("gemma4", "Gemma4Config", "sentencepiece", GEMMA4_TEXT, always_tied=True,
                       text_config_class="Gemma4TextConfig"),
    # Llama 4 Maverick's interleaving in 4 layers (dense, MoE, dense, MoE; the 4th without RoPE) with Scout's
    # choices: 4 experts, 1 per token, a shared expert as wide as one, q/k norms, llama3 RoPE scaling (factor 16, the
    # original context 64 positions so that it changes the tests' sequences, rope_theta 500000)
    "llama4_text": TinyArch("llama4_text", "Llama4TextConfig", "bpe", LLAMA4_TEXT),
    # Llama 4 as released (Llama4ForConditionalGeneration): the text model above and a tiny vision tower
    "llama4": TinyArch("llama4", "Llama4Config", "bpe", LLAMA4_TEXT, text_config_class="Llama4TextConfig"),
    # Granite-4.0-H-Micro's choices in 4 layers (Mamba-2, Mamba-2, attention, Mamba-2): no RoPE, no experts (the
    # shared MLP only), its multipliers' sizes (embedding 12, attention 1/64, residual 0.22, logits 8 as 3, 0.05,
    # 0.5, 2); 8 Mamba heads of 32 over an inner size of twice the hidden size, a state of 16, a 4-tap convolution
    "granitemoehybrid": TinyArch("granitemoehybrid", "GraniteMoeHybridConfig", "bpe", (
        ("num_hidden_layers", 4), ("layer_types", ["mamba", "mamba", "attention", "mamba"]),
        ("position_embedding_type", "nope"), ("num_local_experts", 0), ("num_experts_per_tok", 0),
        ("shared_intermediate_size", 256), ("mamba_n_heads", 8), ("mamba_d_head", 32), ("mamba_d_state", 16),
        ("mamba_n_groups", 1), ("mamba_d_conv", 4), ("mamba_expand", 2),
        ("embedding_multiplier", 3.0), ("residual_multiplier", 0.5), ("attention_multiplier", 0.05),
        ("logits_scaling", 2.0))),
    # Qwen1.5-MoE-A2.7B's choices: top-k weights not renormalized, a shared expert 4x an expert's width
    "qwen2_moe": TinyArch("qwen2_moe", "Qwen2MoeConfig", "bpe", (
        ("use_sliding_window", False), ("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 64),
        ("shared_expert_intermediate_size", 256), ("norm_topk_prob", False), ("decoder_sparse_step", 1),
        ("mlp_only_layers", []))),
}

# Head dim 32: the smallest the vLLM CPU attention backend accepts.
TINY_DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.08,
)

# Gemma 3's vision inputs, tiny: 32-pixel images, pooled to 4 tokens each; its tokenizer's image tokens.
VISION_IMAGE_SIZE = 32
MM_TOKENS_PER_IMAGE = 4
# Gemma's vocabulary holds runs of 1-4 newlines as pieces; vLLM's Gemma 3 processor looks them up around images.
NEWLINE_PIECES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}

WIDE_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_base(
    arch: str,
    out: Path,
    dtype: str = "fp32",
    tied: bool = False,
    seed: int = 0,
    max_shard_size: str = "400KB",
    dims: dict | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a tiny HF model dir (config, generation config, tokenizer, sharded safetensors); ``tokenizer_dir``:
    its tokenizer files instead of the architecture's tiny one (a real tokenizer, the vocabulary sized to it)."""
    import shutil

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    spec = TINY_ARCHS[arch]
    out = Path(out)
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)
    else:
        TOKENIZER_WRITERS[spec.tokenizer](out)
    tok = AutoTokenizer.from_pretrained(out)
    gemma_vision = spec.text_config_class and spec.model_type == "gemma3"
    if gemma_vision:  # Gemma 3's image tokens and processor, as its checkpoints ship them
        tok = _write_image_processor(out)
    config_cls = getattr(transformers, spec.config_class)
    text_cls = getattr(transformers, spec.text_config_class or spec.config_class)
    config = text_cls(
        vocab_size=len(tok),
        tie_word_embeddings=tied or spec.always_tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{**TINY_DIMS, **dict(spec.extra), **(dims or {})},  # dims override the architecture's extras
    )
    if getattr(config, "vocab_size_per_layer_input", None):  # Gemma 4's per-layer embeddings: the same vocabulary
        config.vocab_size_per_layer_input = len(tok)
    model_class = AutoModelForCausalLM
    if gemma_vision:  # head size 32 in the vision tower too (vLLM's CPU attention)
        vision = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=VISION_IMAGE_SIZE, patch_size=8)
        config = config_cls(text_config=config.to_dict(), vision_config=vision.to_dict(),
                            mm_tokens_per_image=MM_TOKENS_PER_IMAGE, image_token_index=tok.image_token_id,
                            boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                            tie_word_embeddings=config.tie_word_embeddings)
    elif spec.model_type == "gemma4":  # Gemma 4 as released: a tiny vision tower, no audio (the 31B's layout)
        if config.pad_token_id is None:  # its forward pads image positions with it (Gemma's <pad> is id 0)
            config.pad_token_id = 0
        vision = transformers.Gemma4VisionConfig(**GEMMA4_VISION)
        config = config_cls(text_config=config.to_dict(), vision_config=vision.to_dict(), audio_config=None,
                            tie_word_embeddings=config.tie_word_embeddings)
        model_class = transformers.AutoModelForImageTextToText
    elif spec.model_type == "llama4":  # Llama 4 as released: a tiny vision tower
        vision = transformers.Llama4VisionConfig(**LLAMA4_VISION)
        config = config_cls(text_config=config.to_dict(), vision_config=vision.to_dict(),
                            tie_word_embeddings=config.tie_word_embeddings)
        model_class = transformers.AutoModelForImageTextToText
    elif spec.text_config_class:  # Qwen3.5 as released: a tiny vision tower (AutoModelForCausalLM: the text model)
        vision = _qwen3_5_vision_class(spec.model_type)(**{**QWEN3_5_VISION, "out_hidden_size": config.hidden_size})
        config = config_cls(text_config=config.to_dict(), vision_config=vision.to_dict(),
                            tie_word_embeddings=config.tie_word_embeddings)
        model_class = transformers.AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = model_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so that norm handling is tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4 scales each layer's output (released values 0.02-0.9)
                b.copy_(0.5 + 0.5 * torch.rand_like(b))
    model = model.to(DTYPES[dtype])
    model.save_pretrained(out, max_shard_size=max_shard_size)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, do_sample=False, max_new_tokens=32
    ).save_pretrained(out)
    _set_config_dtype(out / "config.json", dtype)
    return out


def _qwen3_5_vision_class(model_type: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    return next(getattr(module, n) for n in dir(module) if n.endswith("VisionConfig"))


def _write_image_processor(out: Path):
    """Gemma 3's three image tokens and newline pieces added to the tokenizer, and its processor (32-pixel
    images, 4 tokens each) written beside it; the tokenizer returned."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    tok = AutoTokenizer.from_pretrained(out, extra_special_tokens=IMAGE_TOKENS)
    tok.add_tokens(NEWLINE_PIECES)
    image = Gemma3ImageProcessor(size={"height": VISION_IMAGE_SIZE, "width": VISION_IMAGE_SIZE})
    Gemma3Processor(image_processor=image, tokenizer=tok, image_seq_length=MM_TOKENS_PER_IMAGE).save_pretrained(out)
    return tok


def _set_config_dtype(path: Path, dtype: str) -> None:
    cfg = json.loads(path.read_text())
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    cfg["torch_dtype"] = name
    if "dtype" in cfg:
        cfg["dtype"] = name
    path.write_text(json.dumps(cfg, indent=2))
