"""Qwen3.5 / 3.6 as released (``Qwen3_5ForConditionalGeneration``: the text model under ``model.language_model``, a
vision tower under ``model.visual``, a multi-token-prediction head under ``mtp``): merge keeps the whole checkpoint;
GGUF and MLX export its text model (``qwen3_5_text``). transformers 5's AutoModelForCausalLM loads the text model
alone from it (as Unsloth and TRL fine-tune it), so adapters name either layout."""

from .qwen3_5_text import ARCH as TEXT
from .spec import ArchSpec, TextTower, under_language_model

ARCH = ArchSpec(
    "qwen3_5",
    ("Qwen3_5ForConditionalGeneration",),
    gguf_arch="qwen35",
    rope_style="neox",
    **under_language_model(TEXT),
    notes=("multimodal: merge keeps the vision tower and the multi-token-prediction head; GGUF and MLX export the "
           "text model",),
    text_tower=TextTower(
        "qwen3_5_text", "Qwen3_5TextConfig",
        # the checkpoint's names, then an adapter's trained on the text model AutoModelForCausalLM loads from it
        renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."), ("model.layers.", "model.layers."),
                 ("model.embed_tokens.", "model.embed_tokens."), ("model.norm.", "model.norm.")),
        vision=("model.visual.", "mtp."),
        # an adapter trained on the text model AutoModelForCausalLM loads (PEFT's model.layers.*) names the
        # checkpoint's model.language_model.*
        checkpoint_renames=(("model.", "model.language_model."),),
    ),
    refusals={"vllm": TEXT.refusals["vllm"],
              "awq": TEXT.refusals["awq"]},
)
