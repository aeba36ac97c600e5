"""A tiny model from a real ``config.json``: the same keys and values as the file, except sizes (hidden size,
heads, layers, experts, vocabulary) and the token ids that follow from the tiny tokenizer, so a test runs what a
user's checkpoint declares (its RoPE scaling, windows, soft-caps, biases, metadata keys) in seconds.

The file written is the real one, shrunk, key for key as the user has it (not the config transformers would save),
so every exporter reads the keys real checkpoints carry.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from tuneport.convert.arch.exaone4 import WINDOW_DEPTH
from tuneport.convert.stored.mxfp4 import decode as decode_mxfp4
from tuneport.convert.stored.mxfp4 import encode as encode_mxfp4

from .models import GEMMA4_VISION, LLAMA4_VISION, QWEN3_5_VISION, TINY_ARCHS, _write_image_processor
from .tokenizers import TOKENIZER_WRITERS

HIDDEN, HEADS, INTERMEDIATE, EXPERT_INTERMEDIATE, EXPERTS, TOP_K = 128, 4, 256, 64, 4, 2
MIN_LAYERS = 4
PER_LAYER_INPUT = 16  # Gemma 4's per-layer embedding width
KEPT_DEPTHS = {"exaone4": (WINDOW_DEPTH,)}  # llama.cpp runs EXAONE 4's sliding windows at 64 layers only
KEPT_EXPERTS = {"llama4_text": (128,)}  # llama.cpp's llama4 graph drops the q/k norm at 128 experts (Maverick) only
# a multimodal config's vision tower, tiny (as toolkit/tiny/models.py builds them), by the checkpoint's model_type
SIGLIP = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 32, "patch_size": 8}
QWEN3_5_TINY_VISION = {**QWEN3_5_VISION, "out_hidden_size": HIDDEN}
VISION = {"gemma3": SIGLIP, "qwen3_5": QWEN3_5_TINY_VISION, "qwen3_5_moe": QWEN3_5_TINY_VISION, "gemma4": GEMMA4_VISION,
          "llama4": LLAMA4_VISION}
# Gemma 4 E2B / E4B's audio tower, tiny (its output projected to the text model's width by embed_audio)
GEMMA4_AUDIO = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "subsampling_conv_channels": [8, 4], "output_proj_dims": 64}
# Gated DeltaNet heads (Qwen3.5): 2 key heads, 4 value heads where the real ones differ, 64 wide
LINEAR_KEY_HEADS, LINEAR_HEAD_DIM = 2, 64
MAMBA_HEADS, MAMBA_STATE = 8, 16  # Granite 4's Mamba-2 layers: heads of 2 x HIDDEN / 8, a state of 16
MM_TOKENS_PER_IMAGE = 4


def _layers(cfg: dict, derived: dict) -> int:
    """Enough layers to hold each per-layer pattern once (Gemma 3: 5 sliding, 1 global; SmolLM3: RoPE off on every
    4th), whether the file lists it or transformers derives it; at least MIN_LAYERS. A depth an engine keys its graph
    on (KEPT_DEPTHS) stays as it is."""
    if cfg.get("num_hidden_layers") in KEPT_DEPTHS.get(cfg.get("model_type"), ()):
        return int(cfg["num_hidden_layers"])
    n = MIN_LAYERS
    for key in ("layer_types", "no_rope_layers"):
        values = cfg.get(key, derived.get(key))
        if isinstance(values, list) and values:
            distinct = set(map(str, values))
            n = max(n, next(k for k in range(1, len(values) + 1) if set(map(str, values[:k])) == distinct))
    return n


def shrink_text_config(real: dict, vocab_size: int, ids: dict) -> dict:
    """``real`` (a text model's config) with tiny sizes and the tiny tokenizer's ids; every other key as it is."""
    from tuneport.convert.config_reads import built_config

    cfg = copy.deepcopy(real)
    heads, layers = cfg.get("num_attention_heads"), cfg.get("num_hidden_layers")
    n = _layers(cfg, (built_config(real) or {}) if "model_type" in real else {})
    if "hidden_size" in cfg:
        cfg["hidden_size"] = HIDDEN
    if "intermediate_size" in cfg:
        cfg["intermediate_size"] = INTERMEDIATE
    if heads:
        kv = cfg.get("num_key_value_heads")
        cfg["num_attention_heads"] = HEADS
        if kv is not None:
            cfg["num_key_value_heads"] = HEADS if kv == heads else HEADS // 2
        if cfg.get("head_dim") is not None:  # redundant (= hidden / heads) stays redundant, a distinct one distinct
            same = real.get("hidden_size") and real["head_dim"] * heads == real["hidden_size"]
            cfg["head_dim"] = HIDDEN // HEADS if same else 2 * HIDDEN // HEADS
    if layers and cfg.get("num_kv_shared_layers"):  # Gemma 4: its layer pattern once, then shared once again
        cfg["num_kv_shared_layers"], n = n, 2 * n
    if layers:
        cfg["num_hidden_layers"] = n
        for key in ("layer_types", "no_rope_layers"):
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][:n]
        if isinstance(cfg.get("max_window_layers"), int):
            cfg["max_window_layers"] = round(cfg["max_window_layers"] * n / layers)
        if isinstance(cfg.get("mlp_only_layers"), list):
            cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < n]
    if cfg.get("linear_num_key_heads"):
        grouped = cfg.get("linear_num_value_heads") != cfg["linear_num_key_heads"]
        cfg["linear_num_key_heads"] = LINEAR_KEY_HEADS
        cfg["linear_num_value_heads"] = 2 * LINEAR_KEY_HEADS if grouped else LINEAR_KEY_HEADS
        for key in ("linear_key_head_dim", "linear_value_head_dim"):
            if key in cfg:
                cfg[key] = LINEAR_HEAD_DIM
    if cfg.get("mamba_n_heads"):  # Granite 4's Mamba-2 heads over the tiny inner size (expand x hidden), a small state
        cfg["mamba_n_heads"] = MAMBA_HEADS
        if isinstance(cfg.get("mamba_d_head"), int):
            cfg["mamba_d_head"] = int(cfg.get("mamba_expand") or 2) * HIDDEN // MAMBA_HEADS
        if cfg.get("mamba_d_state"):
            cfg["mamba_d_state"] = MAMBA_STATE
    if cfg.get("shared_intermediate_size"):  # Granite 4's shared MLP: as wide as the dense one or as an expert
        cfg["shared_intermediate_size"] = EXPERT_INTERMEDIATE if cfg.get("num_local_experts") else INTERMEDIATE
    if cfg.get("global_head_dim") and real.get("head_dim"):  # Gemma 4's full layers: the same ratio to head_dim
        cfg["global_head_dim"] = cfg["head_dim"] * real["global_head_dim"] // real["head_dim"]
    if cfg.get("num_global_key_value_heads") and heads:
        cfg["num_global_key_value_heads"] = max(1, cfg["num_global_key_value_heads"] * HEADS // heads)
    if cfg.get("hidden_size_per_layer_input"):
        cfg["hidden_size_per_layer_input"] = PER_LAYER_INPUT
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) and cfg[key] not in KEPT_EXPERTS.get(cfg.get("model_type"), ()):
            cfg[key] = EXPERTS
    if cfg.get("num_experts_per_tok"):
        cfg["num_experts_per_tok"] = min(TOP_K, cfg["num_experts_per_tok"])  # top-1 routing (Llama 4) kept
    if cfg.get("intermediate_size_mlp"):  # Llama 4: the dense layers' width; intermediate_size is the experts'
        cfg["intermediate_size_mlp"], cfg["intermediate_size"] = INTERMEDIATE, EXPERT_INTERMEDIATE
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.get(key):
            cfg[key] = EXPERT_INTERMEDIATE
    if "vocab_size" in cfg or "hidden_size" in cfg:
        cfg["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in cfg:  # Gemma 4's per-layer embeddings: the same vocabulary
            cfg["vocab_size_per_layer_input"] = vocab_size
    for key, value in ids.items():
        if key in cfg:
            cfg[key] = [value] if isinstance(cfg[key], list) and value is not None else value
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = "float32"  # the tiny weights; every target writes its own dtype
    _shrink_rope_factors(cfg)
    return cfg


def _shrink_rope_factors(cfg: dict) -> None:
    """LongRoPE's per-frequency factors (Phi-3.5, Phi-4-mini) have one entry per rotated pair: as many as the tiny
    head rotates."""
    head = cfg.get("head_dim") or HIDDEN // HEADS
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        pairs = int(head * partial) // 2
        for factors in ("long_factor", "short_factor"):
            if isinstance(rope.get(factors), list):
                rope[factors] = rope[factors][:pairs]


def _store_experts_as_mxfp4(out: Path) -> None:
    """Rewrite the saved fused expert weights ([E, in, out]) as gpt-oss's checkpoints hold them: MXFP4 ``_blocks``
    and ``_scales`` over [E, out, in] (exact: the values were made MXFP4 numbers before saving)."""
    from safetensors.torch import load_file, save_file

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            if index is not None:
                del index["weight_map"][name]
                index["weight_map"].update({f"{name}_blocks": shard.name, f"{name}_scales": shard.name})
        save_file(tensors, shard, metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))


def make_base_like(real_config: dict, out: Path, seed: int = 0) -> Path:
    """Write a tiny HF model directory whose ``config.json`` is ``real_config`` shrunk (see the module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out)
    model_type = real_config["model_type"]
    multimodal = isinstance(real_config.get("text_config"), dict)
    text_type = real_config["text_config"].get("model_type", model_type) if multimodal else model_type
    tiny = TINY_ARCHS.get(text_type) or TINY_ARCHS.get(model_type)
    TOKENIZER_WRITERS[tiny.tokenizer if tiny else "bpe"](out)
    gemma_vision = multimodal and model_type == "gemma3"  # its image tokens and processor, as it ships them
    tok = _write_image_processor(out) if gemma_vision else AutoTokenizer.from_pretrained(out)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if multimodal:
        cfg = copy.deepcopy(real_config)
        cfg["text_config"] = shrink_text_config(cfg["text_config"], len(tok), {})
        cfg["text_config"].setdefault("vocab_size", len(tok))
        cfg["vision_config"] = {**cfg.get("vision_config", {}), **VISION.get(model_type, SIGLIP)}
        if isinstance(cfg.get("audio_config"), dict):
            cfg["audio_config"] = {**cfg["audio_config"], **GEMMA4_AUDIO}
        if gemma_vision:
            cfg.update({k: v for k, v in {"mm_tokens_per_image": MM_TOKENS_PER_IMAGE,
                                          "image_token_index": tok.image_token_id, "boi_token_index": tok.boi_token_id,
                                          "eoi_token_index": tok.eoi_token_id}.items() if k in cfg})
        cfg.update({k: [v] if isinstance(cfg[k], list) else v for k, v in ids.items() if k in cfg and v is not None})
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = "float32"
    else:
        cfg = shrink_text_config(real_config, len(tok), ids)
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"  # gpt-oss as released
    config = type(AutoConfig.for_model(model_type)).from_dict(
        {k: v for k, v in copy.deepcopy(cfg).items() if not (mxfp4 and k == "quantization_config")})
    torch.manual_seed(seed)
    # the class the config names (a multimodal Qwen3.5, whose config AutoModelForCausalLM builds the text model of)
    import transformers

    named = getattr(transformers, next(iter(cfg.get("architectures") or []), ""), None)
    model = (named._from_config(config, dtype=torch.float32) if multimodal and isinstance(named, type)
             else AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with torch.no_grad():  # norms away from 1, biases away from 0: their handling is tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif p.dim() == 2 and "vision" not in name:
                p.normal_(0.0, 0.08)  # as the tiny bases: logits that differ visibly between tokens
            if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.08)
                p.copy_(decode_mxfp4(*encode_mxfp4(p.transpose(1, 2))).transpose(1, 2))  # values MXFP4 holds
    model.save_pretrained(out, max_shard_size="400KB")
    if mxfp4:
        _store_experts_as_mxfp4(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")  # the user's keys, not the ones saved
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, do_sample=False,
                     max_new_tokens=32).save_pretrained(out)
    return out
