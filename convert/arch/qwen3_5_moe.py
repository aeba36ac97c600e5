"""Qwen3.5 / 3.6 mixture-of-experts as released (``Qwen3_5MoeForConditionalGeneration``, Qwen3.6-35B-A3B): the text
model (``qwen3_5_moe_text``) under ``model.language_model`` beside a vision tower and a multi-token-prediction head,
laid out as ``qwen3_5``'s: merge keeps the whole checkpoint, GGUF and MLX export its text model."""

from .qwen3_5 import ARCH as DENSE
from .qwen3_5_moe_text import ARCH as TEXT
from .spec import ArchSpec, TextTower

ARCH = ArchSpec(
    "qwen3_5_moe",
    ("Qwen3_5MoeForConditionalGeneration",),
    gguf_arch="qwen35moe",
    rope_style="neox",
    embed=DENSE.embed,
    final_norm=DENSE.final_norm,
    layer_prefix=DENSE.layer_prefix,
    linear_modules=TEXT.linear_modules,
    vllm_lora_modules=TEXT.vllm_lora_modules,
    experts=TEXT.experts,
    notes=DENSE.notes,
    text_tower=TextTower("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", renames=DENSE.text_tower.renames,
                         vision=DENSE.text_tower.vision, checkpoint_renames=DENSE.text_tower.checkpoint_renames),
    refusals={"vllm": TEXT.refusals["vllm"], "awq": TEXT.refusals["awq"]},
)
