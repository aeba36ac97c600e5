"""Llama 4 as released (``Llama4ForConditionalGeneration``, Scout and Maverick): the text model (``llama4_text``)
under ``language_model`` beside a vision tower (``vision_model``) and its projection (``multi_modal_projector``), in
the hub's layout, which is also transformers 5's module tree: merge keeps the whole checkpoint; GGUF and MLX export
its text model. transformers' AutoModelForCausalLM loads the text model alone from it, so adapters name either
layout."""

from .llama4_text import ARCH as TEXT
from .spec import ArchSpec, TextTower, under_hub_language_model

ARCH = ArchSpec(
    "llama4",
    ("Llama4ForConditionalGeneration",),
    gguf_arch="llama4",
    rope_style="interleaved",
    **under_hub_language_model(TEXT),
    experts=TEXT.experts,
    notes=("multimodal: merge keeps the vision tower; GGUF and MLX export the text model",),
    text_tower=TextTower(
        "llama4_text", "Llama4TextConfig",
        # the checkpoint's names, then an adapter's trained on the text model AutoModelForCausalLM loads from it
        renames=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.", "model."), ("lm_head.", "lm_head.")),
        vision=("vision_model.", "multi_modal_projector."),
        checkpoint_renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    ),
    refusals={"vllm": "not proven yet for the multimodal checkpoint (vLLM's Llama4ForConditionalGeneration with its "
                      "processor); its text model is: load the checkpoint with AutoModelForCausalLM, save it, export "
                      "that",
              "awq": TEXT.refusals["awq"], "exl3": TEXT.refusals["exl3"]},
)
