"""The support matrix: architecture x target, each cell read from the table of the target that decides it
(``convert.arch``: each entry's facts for that target), with the reason where a target refuses.

``docs/architectures.md`` is generated from it (``python -m tuneport.toolkit.arch_docs``), and the parity tests
take their architectures from it, so a new table entry is tested on every target it claims.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .arch import ARCHS


@dataclass(frozen=True)
class MatrixColumn:
    key: str
    title: str
    engine: str  # what runs the artifact (and serves it)
    tests: tuple[str, ...]  # the parity tests parametrized from this column: tests/<file>::<function>


COLUMNS: tuple[MatrixColumn, ...] = (
    MatrixColumn("merge", "merge (HF safetensors)", "transformers",
           ("tests/test_merge_equivalence.py::test_every_architecture_merges_like_peft",)),
    MatrixColumn("gguf", "GGUF + GGUF LoRA", "llama.cpp (`serve --engine llamacpp`)",
           ("tests/test_gguf_export.py::test_model_parity_f32_f16_q8",
            "tests/test_gguf_export.py::test_every_architecture_lora_matches_peft")),
    MatrixColumn("vllm", "vLLM bundle", "vLLM (`serve --engine vllm`)",
           ("tests/test_vllm_export.py::test_every_architecture_serves_like_peft",
            "tests/test_vllm_export.py::test_vllm_serves_bundle_and_merged_like_peft")),
    MatrixColumn("awq", "AWQ (compressed-tensors)", "vLLM",
           ("tests/test_awq.py::test_block_pass_equals_the_whole_model_forward",
            "tests/test_awq.py::test_folded_scales_leave_the_float_block_unchanged",
            "tests/test_awq.py::test_every_architecture_runs_in_vllm_as_tuneport_decodes_it")),
    MatrixColumn("mlx", "MLX", "mlx-lm (`serve --engine mlx`)",
           ("tests/test_mlx_export.py::test_every_architecture_equals_transformers",)),
    MatrixColumn("exl3", "EXL3", "ExLlamaV3 / TabbyAPI, CUDA only (`serve --engine exllamav3`)",
           ("tests/test_exl3.py::test_every_architecture_writes_and_decodes",)),
)

# target -> "module:function" under tuneport.convert that says why it refuses a model_type (None: it
# exports it); merge reads the HF layout as it is, so every architecture in ARCHS.
REFUSALS: dict[str, str] = {
    "merge": ":", "vllm": "vllm_rules:vllm_refusal", "gguf": "gguf.model:gguf_refusal",
    "awq": "calibration.archs:awq_refusal", "mlx": "mlx.archs:mlx_refusal", "exl3": "exl3.converter:exl3_refusal",
}

# Bases users fine-tune that have no entry yet: what a user sees in the matrix instead of a silent gap.
NOT_YET: dict[str, str] = {}
NOT_YET_REASON = "no table entry yet: every target refuses it as an unsupported architecture"


def cell(target: str, model_type: str) -> str | None:
    """None when ``target`` exports ``model_type``; else the reason it refuses."""
    from .multimodal import FULL_TARGETS, MULTIMODAL_REFUSAL, TEXT_ONLY_TARGETS, TEXT_TOWERS

    if model_type in TEXT_TOWERS and target not in FULL_TARGETS:
        if target not in TEXT_ONLY_TARGETS:
            return MULTIMODAL_REFUSAL
        return cell(target, TEXT_TOWERS[model_type].text_model_type)
    if model_type not in ARCHS:
        return NOT_YET_REASON
    module, function = REFUSALS[target].split(":")
    if not module:
        return None
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)(model_type)


def model_types() -> list[str]:
    """Every row of the matrix: the architectures, then the multimodal checkpoints whose text model is one."""
    from .multimodal import TEXT_TOWERS

    return [*ARCHS, *(m for m in TEXT_TOWERS if m not in ARCHS)]


def supported(target: str) -> list[str]:
    """The architectures ``target`` exports, in table order."""
    return [m for m in model_types() if cell(target, m) is None]


def matrix() -> dict[str, dict[str, str | None]]:
    """model_type -> target key -> None (supported) or the reason."""
    return {m: {t.key: cell(t.key, m) for t in COLUMNS} for m in model_types()}
