"""Gemma 4 as released (``Gemma4ForConditionalGeneration``: the text model under ``model.language_model``, a vision
tower and its projection under ``model.vision_tower`` / ``model.embed_vision``, the E2B / E4B's audio tower under
``model.audio_tower`` / ``model.embed_audio``, the LM head at the root): merge keeps the whole checkpoint; GGUF and
MLX export its text model (``gemma4_text``). transformers 5's AutoModelForCausalLM loads the text model alone from
it, so adapters name either layout."""

from .gemma4_text import ARCH as TEXT
from .spec import ArchSpec, TextTower, under_language_model

TEXT_MODEL_PARTS = ("layers.", "embed_tokens.", "norm.", "embed_tokens_per_layer.", "per_layer_model_projection.",
                    "per_layer_projection_norm.")

ARCH = ArchSpec(
    "gemma4",
    ("Gemma4ForConditionalGeneration",),
    gguf_arch="gemma4",
    rope_style="neox",
    **under_language_model(TEXT),
    notes=("multimodal: merge keeps the vision and audio towers; GGUF and MLX export the text model",),
    text_tower=TextTower(
        "gemma4_text", "Gemma4TextConfig",
        # the checkpoint's names, then an adapter's trained on the text model AutoModelForCausalLM loads from it
        renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."),
                 *((f"model.{p}", f"model.{p}") for p in TEXT_MODEL_PARTS)),
        vision=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio."),
        checkpoint_renames=(("model.", "model.language_model."),),
    ),
    refusals={"vllm": "not proven yet for the multimodal checkpoint (vLLM's Gemma4ForConditionalGeneration with its "
                      "processor); its text model is: load the checkpoint with AutoModelForCausalLM, save it, export "
                      "that",
              "awq": TEXT.refusals["awq"], "exl3": TEXT.refusals["exl3"]},
)
