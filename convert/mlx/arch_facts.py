"""The vocabulary of an architecture's MLX facts (an entry of ``convert.arch`` holds one ``MlxArch``): what
mlx-lm 0.32 reads differently from transformers (data, not if-chains).

mlx-lm builds each model from ``config.json`` with its own ``ModelArgs``: some keys it reads only at the
top level, where transformers 5 nests them (``rope_parameters``); where a key is missing it silently
uses its own default (a qwen2 without a top-level ``rope_theta`` runs with base 1e6 — wrong logits).
Each architecture lists the fixes its exported config needs and how its model differs from the HF one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..config_audit import KeyRule
from ..errors import UserError
from ..layer_kinds import granite_hybrid_experts, granite_hybrid_layer_kinds, lfm2_layer_kinds

ConfigFix = Callable[[dict], list[str]]  # fills the config in place; returns what it filled (for the manifest)


def _rope_scaling(params: dict) -> dict | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    return {**{k: v for k, v in params.items() if k != "rope_theta"}, "type": kind, "rope_type": kind}


def every_nth(flags: list[bool], hint: int | None = None) -> int | None:
    """The n (at most the layer count; ``hint`` tried first) for which layer i is flagged iff (i + 1) % n == 0, the
    way mlx-lm places a model's other kind of layer (Gemma 3's global ones, Qwen3.5's full-attention ones); None if
    no n gives ``flags``."""
    candidates = ([hint] if hint else []) + list(range(1, len(flags) + 1))
    return next((n for n in candidates if n <= len(flags)
                 and all(f == ((i + 1) % n == 0) for i, f in enumerate(flags))), None)


def rope_top_level(cfg: dict) -> list[str]:
    """transformers 5 keeps the rope base (and partial_rotary_factor, scaling) in ``rope_parameters``;
    mlx-lm reads ``rope_theta``, ``partial_rotary_factor`` and ``rope_scaling`` at the top level."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return []
    filled = []
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in params and key not in cfg:
            cfg[key] = params[key]
            filled.append(key)
    if cfg.get("rope_scaling") is None and (scaling := _rope_scaling(params)) is not None:
        cfg["rope_scaling"] = scaling
        filled.append("rope_scaling")
    return filled


def gemma3_rope_and_windows(cfg: dict) -> list[str]:
    """Gemma 3: one rope base per attention kind (``rope_parameters.full_attention`` /
    ``sliding_attention``) become ``rope_theta`` / ``rope_local_base_freq``; ``layer_types`` become
    mlx-lm's ``sliding_window_pattern`` (layer i is global iff (i + 1) % pattern == 0)."""
    filled = []
    params = cfg.get("rope_parameters") or {}
    for kind, key in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
        p = params.get(kind)
        if isinstance(p, dict) and "rope_theta" in p and key not in cfg:
            cfg[key] = p["rope_theta"]
            filled.append(key)
            if kind == "full_attention" and cfg.get("rope_scaling") is None and (s := _rope_scaling(p)):
                cfg["rope_scaling"] = s
                filled.append("rope_scaling")
    types = cfg.get("layer_types")
    if types and "sliding_window_pattern" not in cfg:
        # mlx-lm needs a global layer within the first `pattern` layers (it reads that layer's cache)
        pattern = every_nth([t != "sliding_attention" for t in types], cfg.get("_sliding_window_pattern"))
        if pattern is None:
            raise UserError(f"Gemma 3 layer_types {types} follow no pattern mlx-lm can express",
                            "mlx-lm needs a global layer every sliding_window_pattern layers (at most the layer "
                            "count); export for another engine")
        cfg["sliding_window_pattern"] = pattern
        filled.append("sliding_window_pattern")
    return filled


def lfm2_config(cfg: dict) -> list[str]:
    """LFM2: mlx-lm requires ``block_dim`` (the MLP's input, the hidden size, which transformers never writes) and
    takes ``full_attn_idxs`` over ``layer_types`` (transformers the other way round): both written from the layer
    kinds transformers runs. It reads rope_theta from rope_parameters and applies no RoPE scaling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise UserError(f"this LFM2 model scales its RoPE ({params}), which mlx-lm's lfm2 does not implement",
                        "export it for llama.cpp (--target gguf)")
    filled = []
    kinds = lfm2_layer_kinds(cfg)
    attention = [i for i, t in enumerate(kinds) if t == "full_attention"]
    if cfg.get("layer_types") != kinds:
        cfg["layer_types"] = kinds
        filled.append("layer_types")
    if cfg.get("full_attn_idxs") != attention:
        cfg["full_attn_idxs"] = attention
        filled.append("full_attn_idxs")
    if cfg.get("block_dim") is None:
        cfg["block_dim"] = cfg["hidden_size"]
        filled.append("block_dim")
    return filled


def olmo3_rope(cfg: dict) -> list[str]:
    """OLMo 3: mlx-lm reads one ``rope_theta`` (every layer) and ``rope_scaling`` (full-attention layers only, as
    transformers applies it) at the top level; transformers 5 nests them per layer kind."""
    params = cfg.get("rope_parameters") or {}
    if not ("full_attention" in params or "sliding_attention" in params):
        return rope_top_level(cfg)
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if sliding.get("rope_theta", full.get("rope_theta")) != full.get("rope_theta") or \
            sliding.get("rope_type", "default") != "default":
        raise UserError(f"this OLMo 3 model's sliding layers have their own RoPE ({sliding}), which mlx-lm does "
                        "not implement (it gives them the full layers' base, unscaled)",
                        "export it for llama.cpp (--target gguf)")
    filled = []
    if "rope_theta" in full and "rope_theta" not in cfg:
        cfg["rope_theta"] = full["rope_theta"]
        filled.append("rope_theta")
    if cfg.get("rope_scaling") is None and (scaling := _rope_scaling(full)) is not None:
        cfg["rope_scaling"] = scaling
        filled.append("rope_scaling")
    return filled


def rope_scaling_key(cfg: dict) -> list[str]:
    """mlx-lm's EXAONE 4 requires a ``rope_scaling`` key (None: no scaling), which transformers 5 does not write."""
    if "rope_scaling" in cfg:
        return []
    cfg["rope_scaling"] = None
    return ["rope_scaling"]


def no_sliding_window(cfg: dict) -> list[str]:
    """mlx-lm's Llama (which runs Mistral) and Phi-3 have no sliding window: refuse a window shorter than
    the context."""
    window = cfg.get("sliding_window")
    if window and window < cfg.get("max_position_embeddings", 0):
        raise UserError(f"this {cfg.get('model_type')} model uses a sliding window of {window} tokens, which "
                        "mlx-lm does not implement for it (outputs would differ past the window)",
                        "export it for llama.cpp (--target gguf) or vLLM")
    return []


def expert_count_key(cfg: dict) -> list[str]:
    """mlx-lm's Qwen3-MoE requires ``num_experts``; transformers 5 writes ``num_local_experts``."""
    if "num_experts" in cfg or "num_local_experts" not in cfg:
        return []
    cfg["num_experts"] = cfg["num_local_experts"]
    return ["num_experts"]


def qwen3_5_layers(cfg: dict) -> list[str]:
    """Qwen3.5: mlx-lm places the full-attention layers by ``full_attention_interval`` alone (layer i is full iff
    (i + 1) % interval == 0), ignoring ``layer_types``: the interval is written from them, and a pattern no interval
    gives is refused."""
    filled = []
    types = cfg.get("layer_types")
    if types:
        every = every_nth([t == "full_attention" for t in types])
        if every is None:
            raise UserError(f"Qwen3.5 layer_types {types} follow no pattern mlx-lm can express",
                            "mlx-lm makes every full_attention_interval-th layer full attention; export for "
                            "llama.cpp (--target gguf)")
        if cfg.get("full_attention_interval") != every:
            cfg["full_attention_interval"] = every
            filled.append("full_attention_interval")
    return filled


def granite_hybrid_config(cfg: dict) -> list[str]:
    """Granite 4: mlx-lm takes only the hub's layer names ("mamba", "attention"; transformers 5 saves
    "linear_attention", "full_attention"), applies RoPE where ``position_embedding_type`` is missing and clamps the
    step size to (0.001, 100) where ``time_step_limit`` is missing (transformers: neither), and sizes its dense MLP
    (the shared MLP of a model without experts) by ``intermediate_size``: each written as transformers computes."""
    filled = []
    kinds = granite_hybrid_layer_kinds(cfg)
    fixes = {"layer_types": kinds, "position_embedding_type": cfg.get("position_embedding_type") or "nope",
             "time_step_limit": cfg.get("time_step_limit") or [0.0, {"__float__": "Infinity"}]}
    if not granite_hybrid_experts(cfg):
        fixes["intermediate_size"] = cfg["shared_intermediate_size"]
    for key, value in fixes.items():
        if cfg.get(key) != value:
            cfg[key] = value
            filled.append(key)
    return filled


def gemma_embed_factor(cfg: dict) -> float:
    """mlx-lm's Gemma 3 multiplies the embedding lookup (LoRA included) by sqrt(hidden) rounded to bfloat16,
    transformers (and PEFT) by the exact value: their ratio (1.0001 for hidden 128)."""
    import mlx.core as mx

    exact = cfg["hidden_size"] ** 0.5
    return exact / float(mx.array(exact, mx.bfloat16).astype(mx.float32))


@dataclass(frozen=True, eq=False)
class MlxArch:
    mlx_model: str  # the mlx_lm.models module that runs it
    config_fixes: tuple[ConfigFix, ...] = (rope_top_level,)
    # How far mlx-lm's factor after the embedding lookup falls short of transformers': the exporter
    # multiplies the embedding rows (and embedding LoRA) by it; with tied embeddings the output
    # projection grows by it too, which the final norm takes back (its stored weight + norm_offset
    # is what multiplies).
    embed_factor: Callable[[dict], float] | None = None
    norm_offset: float = 0.0
    # mixture of experts: mlx-lm stacks a layer's experts into ``<block>.switch_mlp.<name>`` (disk projection ->
    # name), and some models quantize modules their own way (``quant_predicate``: module path -> params)
    switch_mlp: tuple[tuple[str, str], ...] = ()
    switch_block: str = "switch_mlp"  # the stacked experts' module under the block (gpt-oss: "experts")
    quant_predicate: Callable[[str], dict | None] | None = None
    notes: tuple[str, ...] = ()
    # the class whose fields are the config keys it reads ("module.Class" under mlx_lm.models; "": the model
    # module's ModelArgs)
    args_class: str = ""

    def args(self) -> type:
        """mlx-lm's class whose fields are the config keys this model reads."""
        import importlib

        module, _, name = (self.args_class or f"{self.mlx_model}.ModelArgs").rpartition(".")
        return getattr(importlib.import_module(f"mlx_lm.models.{module}"), name)
    weight_prefix: str = ""  # where the model's modules sit in mlx-lm's tree (a wrapper's "language_model.")
    model_type: str | None = None  # the model_type mlx-lm knows it by, where it differs from transformers'
    # mlx-lm runs the text model only inside its multimodal wrapper (Llama 4's ``llama4``): the config is written
    # nested (``{"model_type": model_type, "text_config": {...}}``) and the weights under ``weight_prefix``
    wrapper: bool = False
    # config keys the config fixes translate into fields mlx-lm reads (the audit's rules for them)
    fixed_rules: Mapping[str, KeyRule] = field(default_factory=lambda: MappingProxyType({}))
