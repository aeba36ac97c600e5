"""PEFT adapters made with ``peft`` itself, one per LoRA feature, with non-zero B."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ADDED_TOKENS = ["<|tool|>", "<|think|>", "<|answer|>"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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

    spec = VARIANTS[variant]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base_dir)
    if spec.add_tokens:
        tok.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
        model.resize_token_embeddings(len(tok))
    lora = dict(spec.lora)
    if lora.get("target_modules") == "all-linear" and hasattr(model, "model") and hasattr(model.model,
                                                                                           "language_model"):
        lora["target_modules"] = LANGUAGE_MODEL_LINEARS  # a multimodal model: the language model's linears
    peft_model = get_peft_model(model, LoraConfig(**lora))
    _randomize(peft_model, seed)
    if customize:
        customize(peft_model)
    out = Path(out)
    peft_model.save_pretrained(out)
    if spec.add_tokens:
        tok.save_pretrained(out)
    return out
