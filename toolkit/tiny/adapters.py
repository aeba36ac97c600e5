"""PEFT adapters made with ``peft`` itself, one per LoRA feature, with non-zero B."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ADDED_TOKENS = ["<|tool|>", "<|think|>", "<|answer|>"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Gemma 4's vision tower wraps its linears (Gemma4ClippableLinear), which PEFT cannot adapt: adapters on it leave the
# towers out, as the real ones do (tests/real/tools/peft--gemma-4-e4b-exclude-regex-peft019)
TOWERS = {"gemma4": r".*(vision_tower|audio_tower|embed_vision|embed_audio).*"}
# Gemma 4's per-layer-input projection (a linear PEFT's all-linear takes): llama.cpp multiplies by it without LoRA
NO_ENGINE_LORA = ("per_layer_model_projection",)
# Llama 4's router is a linear whose forward returns (scores, logits): PEFT 0.22 wraps it under all-linear and then
# fails in forward ("'tuple' object has no attribute 'dtype'"), so real Llama 4 adapters name their targets
NO_PEFT_LORA = ("feed_forward.router",)
LANGUAGE_MODEL_LINEARS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass(frozen=True)
class Variant:
    """One adapter flavour: the LoraConfig arguments and what it needs from the base."""

    name: str
    lora: dict
    tied_base: bool = False
    add_tokens: bool = False
    vllm_refusal: str = ""  # substring of tuneport's vLLM preflight refusal, "" when vLLM accepts it
    mlx_refusal: str = ""  # substring of why it cannot be an mlx-lm adapter, "" when it can
    note: str = ""
    extra: dict = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("plain", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
        Variant("all_linear", dict(r=8, lora_alpha=8, target_modules="all-linear")),
        Variant("rslora", dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj",
                                                                                     "v_proj", "o_proj"])),
        Variant(
            "patterns",
            dict(
                r=8,
                lora_alpha=16,
                target_modules=ALL_LINEAR,
                rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 12},
                alpha_pattern={"v_proj": 4, "o_proj": 32},
            ),
        ),
        Variant("dora", dict(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
                vllm_refusal="DoRA"),
        Variant(
            "modules_to_save",
            dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"]),
            add_tokens=True,
            vllm_refusal="modules_to_save",
            mlx_refusal="replaces whole tensors",
        ),
        Variant("embedding", dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "q_proj"])),
        Variant("tied", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]), tied_base=True),
        Variant("regex", dict(r=8, lora_alpha=16, target_modules=r".*\.(q_proj|k_proj|up_proj)")),
        Variant("layers", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"],
                               layers_to_transform=[1], layers_pattern="layers")),
    ]
}


# Mixture-of-experts adapters (their bases only): LoRA on transformers 5's fused expert parameters, as
# PEFT trains it there, and the per-expert modules transformers 4 trained (make_per_expert_adapter).
MOE_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("experts", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
        Variant("experts_patterns", dict(
            r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"down_proj": 4}, alpha_pattern={"gate_up_proj": 16})),
        Variant("per_expert", {}),
    ]
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every trainable adapter tensor non-zero, seeded values (PEFT starts B at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.2 * noise.to(p.dtype))
            elif "lora_" in name:
                p.copy_((0.15 * noise).to(p.dtype))
            else:  # modules_to_save copies
                p.add_((0.05 * noise).to(p.dtype))


def make_adapter(base_dir: Path, variant: str, out: Path, seed: int = 1,
                 customize: Callable[[torch.nn.Module], None] | None = None) -> Path:
    """Create ``variant`` over the model in ``base_dir`` with PEFT and save it to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if variant == "per_expert":
        return make_per_expert_adapter(base_dir, out, seed)
    spec = {**VARIANTS, **MOE_VARIANTS}[variant]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base_dir)
    if spec.add_tokens:
        tok.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
        model.resize_token_embeddings(len(tok))
    lora = dict(spec.lora)
    multimodal = (hasattr(model, "model") and hasattr(model.model, "language_model")) or hasattr(model, "vision_model")
    if lora.get("target_modules") == "all-linear" and multimodal:
        lora["target_modules"] = LANGUAGE_MODEL_LINEARS  # a multimodal model: the language model's linears
    if (towers := TOWERS.get(model.config.model_type)) and not lora.get("exclude_modules"):
        lora["exclude_modules"] = towers
    if lora.get("target_modules") == "all-linear" and not lora.get("exclude_modules") and any(
            n.endswith(NO_ENGINE_LORA) for n, _ in model.named_modules()):
        lora["exclude_modules"] = list(NO_ENGINE_LORA)  # every linear the engines adapt (the rest: refused, merged)
    if lora.get("target_modules") == "all-linear" and any(n.endswith(NO_PEFT_LORA) for n, _ in model.named_modules()):
        lora["exclude_modules"] = [*lora.get("exclude_modules", ()), *NO_PEFT_LORA]
    if lora.get("target_parameters"):  # the MoE block's name in memory (Llama 4's feed_forward, not mlp)
        from ...convert.arch import arch_for

        block = arch_for(model.config.model_type).experts.memory_block
        lora["target_parameters"] = [t.replace("mlp.", f"{block}.", 1) for t in lora["target_parameters"]]
    peft_model = get_peft_model(model, LoraConfig(**lora))
    _randomize(peft_model, seed)
    if customize:
        customize(peft_model)
    out = Path(out)
    peft_model.save_pretrained(out)
    if spec.add_tokens:
        tok.save_pretrained(out)
    return out


def make_per_expert_adapter(base_dir: Path, out: Path, seed: int = 1, r: int = 4, alpha: int = 8) -> Path:
    """A mixture-of-experts LoRA as transformers 4 trained it: one module per expert projection, under the
    checkpoint's own names (Mixtral ``block_sparse_moe.experts.{e}.w1``), plus q_proj. transformers 5 has no
    such modules (it fuses the experts), so it is written directly; PEFT converts it when loading it."""
    import json

    from safetensors.torch import save_file

    from ...convert.arch import arch_for
    from ...convert.checkpoint import Checkpoint

    ckpt = Checkpoint(base_dir)
    layout = arch_for(ckpt.model_type).experts
    assert layout is not None, f"{ckpt.model_type} has no experts"
    gen = torch.Generator().manual_seed(seed)
    projections = (layout.gate, layout.up, layout.down, "q_proj")
    tensors = {}
    for name in ckpt.names():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in projections:
            continue
        rows, cols = ckpt.meta(name).shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = 0.15 * torch.randn(r, cols, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = 0.15 * torch.randn(rows, r, generator=gen)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(projections), "bias": "none", "base_model_name_or_path": str(base_dir)}, indent=2))
    return out
