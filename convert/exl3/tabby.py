"""TabbyAPI (ExLlamaV3's OpenAI server, AGPL: run, never vendored): the ``config.yml`` that serves one EXL3.

Keys as TabbyAPI documents them in ``config_sample.yml`` (generated from its ``common/config_models.py``); it
reads ``--config PATH`` in place of its own ``config.yml``. Its exllamav3 backend loads no LoRA (``load_loras``
is a stub that fails every adapter), so a fine-tune is served as its own merged EXL3.
"""

from __future__ import annotations

from pathlib import Path

# section -> the keys config_sample.yml documents (TabbyAPI e632af4); tuneport writes a subset
DOCUMENTED_KEYS: dict[str, tuple[str, ...]] = {
    "network": ("host", "port", "disable_auth", "disable_fetch_requests", "send_tracebacks", "api_servers",
                "sse_ping_interval"),
    "model": ("model_dir", "model_name", "backend", "max_seq_len", "cache_size", "cache_mode", "tensor_parallel",
              "tensor_parallel_backend", "gpu_split_auto", "autosplit_reserve", "gpu_split", "cpu_moe_offload_layers",
              "rope_scale", "rope_alpha", "chunk_size", "output_chunking", "max_batch_size", "prompt_template",
              "vision", "template_vars_default", "template_vars_force", "reasoning", "tool_format",
              "inline_model_loading", "use_dummy_models", "dummy_model_names", "use_as_default"),
    "lora": ("lora_dir", "loras"),
}
BACKEND = "exllamav3"  # the only backend TabbyAPI accepts now
CACHE_MODES = ("FP16", "Q8", "Q6", "Q4")  # or "K,V" bit pairs 2..8, e.g. "8,6"
CACHE_QUANTUM = 256  # cache_size must be a multiple of it
DEFAULT_MAX_SEQ_LEN = 4096
CONFIG_NAME = "tabby-config.yml"
LAUNCH = "python main.py --config {config}"  # from a TabbyAPI checkout, with its dependencies installed


def valid_cache_mode(mode: str) -> bool:
    if mode in CACHE_MODES:
        return True
    parts = mode.split(",")
    return len(parts) == 2 and all(p.strip().isdigit() and 2 <= int(p) <= 8 for p in parts)


def round_cache(tokens: int) -> int:
    return -(-max(tokens, 1) // CACHE_QUANTUM) * CACHE_QUANTUM


def tabby_config(model: Path, max_seq_len: int, *, cache_size: int | None = None, cache_mode: str = "FP16",
                 host: str = "127.0.0.1", port: int = 5000, disable_auth: bool = True) -> dict:
    """TabbyAPI's config serving the EXL3 directory ``model`` at start-up, OpenAI routes only, no LoRA."""
    if not valid_cache_mode(cache_mode):
        raise ValueError(f"cache_mode {cache_mode!r}: use FP16, Q8, Q6, Q4 or 'K,V' bits 2..8")
    model = Path(model).absolute()
    return {
        "network": {"host": host, "port": port, "disable_auth": disable_auth, "api_servers": ["OAI"]},
        "model": {"model_dir": str(model.parent), "model_name": model.name, "backend": BACKEND,
                  "max_seq_len": max_seq_len, "cache_size": round_cache(cache_size or max_seq_len),
                  "cache_mode": cache_mode},
    }


def default_max_seq_len(config: dict) -> int:
    n = config.get("max_position_embeddings")
    return min(n, DEFAULT_MAX_SEQ_LEN) if isinstance(n, int) and n > 0 else DEFAULT_MAX_SEQ_LEN


def write_tabby_config(path: Path, config: dict) -> Path:
    import yaml

    header = "# TabbyAPI config written by tuneport: python main.py --config THIS_FILE (in a TabbyAPI checkout)\n"
    Path(path).write_text(header + yaml.safe_dump(config, sort_keys=False))
    return Path(path)
