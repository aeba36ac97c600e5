"""Gemma 3 4B-27B as a whole (text and vision), for the targets that keep the whole checkpoint (merge, vLLM,
AWQ); text-only targets export its text model (``gemma3_text``, ``convert/multimodal.py``). Names: the hub's
layout."""

from .gemma3_text import ARCH as TEXT
from .spec import ArchSpec, TextTower, under_hub_language_model

ARCH = ArchSpec(
    "gemma3",
    ("Gemma3ForConditionalGeneration",),
    gguf_arch="gemma3",
    rope_style="neox",
    **under_hub_language_model(TEXT),
    notes=("multimodal: merge, vLLM and AWQ keep the vision tower (an adapter on it merged too; vLLM serves LoRA "
           "on the language model; AWQ quantizes the language model only); GGUF and MLX export the text model",),
    text_tower=TextTower(
        "gemma3_text", "Gemma3TextConfig",
        renames=(("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
        vision=("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector."),
        checkpoint_renames=(("model.language_model.", "language_model.model."),
                            ("model.vision_tower.", "vision_tower."),
                            ("model.multi_modal_projector.", "multi_modal_projector."),
                            ("lm_head.", "language_model.lm_head.")),
        vllm_renames=(("vision_tower.", "vision_tower.vision_model."),
                      ("model.vision_tower.", "model.vision_tower.vision_model.")),
        memory_prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
        keep_16bit=("re:.*vision_tower.*", "re:.*multi_modal_projector.*"),
    ),
)
