"""EXAONE 4.0: norms after attention and MLP (as OLMo 2), per-head q/k norms; its 32B interleaves sliding-window
layers (RoPE) with global ones (no RoPE). llama.cpp runs the window only for the 64-layer (32B) shape; other
shapes run every layer global with RoPE, which is what transformers does without a window (the 1.2B)."""

from ..calibration.layouts import transformers_layout
from ..config_audit import KeyRule
from ..gguf.arch_facts import COMMON_HPARAMS, SLIDING, GGUFArch
from ..gguf.config_rules import COMMON, LLAMA_ROPE
from ..mlx.arch_facts import MlxArch, rope_scaling_key, rope_top_level
from .olmo2 import OLMO2_GROUPS
from .spec import ArchSpec

WINDOW_DEPTH = 64  # the only depth whose sliding-window layers llama.cpp's exaone4 graph runs
GLOBAL_ONLY = f"llama.cpp runs EXAONE 4's sliding-window layers only in its {WINDOW_DEPTH}-layer (32B) shape"


def _pattern_mlx_runs(value, cfg: dict) -> str | None:
    """mlx-lm's exaone4 builds its sliding (L) and global (G) layers from sliding_window_pattern, cycled, and
    never reads layer_types: they must say the same."""
    if not value or all(t == "full_attention" for t in value):
        return None
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, str) and pattern and [
            "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
            for i in range(len(value))] == list(value):
        return None
    return (f"mlx-lm's exaone4 places sliding layers by sliding_window_pattern ({pattern!r}), which does not give "
            f"layer_types {sorted(set(value))} as listed")


def _windows_llamacpp_runs(value, cfg: dict) -> str | None:
    """Sliding layers only where llama.cpp runs them: the 64-layer shape."""
    sliding = [t for t in (cfg.get("layer_types") or []) if t == "sliding_attention"]
    if sliding and cfg.get("sliding_window") and int(cfg.get("num_hidden_layers") or 0) != WINDOW_DEPTH:
        return f"{GLOBAL_ONLY}; this model has {len(sliding)} sliding layers in {cfg.get('num_hidden_layers')}"
    return None


ARCH = ArchSpec(
    "exaone4",
    ("Exaone4ForCausalLM",),
    gguf_arch="exaone4",
    rope_style="neox",
    notes=("norms after attention and MLP; per-head q/k norms; global layers without RoPE where a window is set",),
    gguf=GGUFArch(COMMON_HPARAMS + SLIDING, {
        **COMMON,
        **LLAMA_ROPE,  # the 1.2B ships llama3 RoPE: llama.cpp's exaone4 graph loads its rope_freqs tensor
        "sliding_window": KeyRule("refused unless", "no sliding layers, or the 64-layer shape", _windows_llamacpp_runs),
        "layer_types": KeyRule("carried", "attention.sliding_window_pattern (the 64-layer shape)",
                               _windows_llamacpp_runs),
        "sliding_window_pattern": KeyRule("inert", "layer_types is what counts"),
    }, write_swa_pattern=True),
    mlx=MlxArch("exaone4", (rope_top_level, rope_scaling_key), fixed_rules={
        "layer_types": KeyRule("carried", "as sliding_window_pattern, which mlx-lm reads", _pattern_mlx_runs)}),
    awq=transformers_layout("exaone4", "Exaone4", OLMO2_GROUPS),
    exl3=True,
)
