"""Every export target as data: its writer, the options it honours, the adapter modes it writes, the checks its
base must pass and what it cannot export; below the writers (each imports what it needs from here or from
``inputs``), above nothing that imports it.

Adding a target means one module (its writer) and one row in ``TARGETS``; the CLI's ``--target`` choices,
the option checks and ``inspect``'s suggestions all come from this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arch import arch_for
from .errors import UserError
from .stored.methods import storage_method

if TYPE_CHECKING:  # the table is imported by the CLI's --help: nothing heavy at import time
    from .checkpoint import Checkpoint
    from .options import ExportOptions

# Options that only some targets honour: field -> (flag, value meaning "not given")
TARGET_OPTIONS: dict[str, tuple[str, object]] = {
    "dtype": ("--dtype", "auto"),
    "quant": ("--quant", None),
    "bpe_pre": ("--bpe-pre", None),
    "name": ("--name", None),
    "max_lora_rank": ("--max-lora-rank", None),
    "quant_format": ("--format", None),
    "group_size": ("--group-size", None),
    "symmetric": ("--symmetric", False),
    "ignore": ("--ignore", []),
    "calib": ("--calib", None),
    "calib_samples": ("--calib-samples", None),
    "calib_seqlen": ("--calib-seqlen", None),
    "bits": ("--bits", None),
    "head_bits": ("--head-bits", None),
    "codebook": ("--codebook", None),
    "work_dir": ("--work-dir", None),
    "dry_run": ("--dry-run", False),
    "accept_config_keys": ("--accept-config-key", []),
    "accept_tokenizer_difference": ("--accept-tokenizer-difference", False),
}


def unquantized(ckpt: Checkpoint) -> None:
    if ckpt.quantization:
        from .adapter_config import unquantized_name

        method = storage_method(ckpt.quantization)
        plain = unquantized_name(ckpt.spec.rstrip("/")) or unquantized_name(str(ckpt.config.get("_name_or_path")))
        raise UserError(f"{ckpt.path} is quantized ({method}); tuneport merges and exports unquantized checkpoints",
                        f"pass its 16-bit weights: --base {plain}" if plain else
                        "pass the original (unquantized) base model")


def known_architecture(ckpt: Checkpoint) -> None:
    arch_for(ckpt.model_type)
    layers_present(ckpt)


def layers_present(ckpt: Checkpoint) -> None:
    """Every layer config.json counts is in the weights (a missing one would be left random or unloadable)."""
    arch, n = arch_for(ckpt.model_type), ckpt.config.get("num_hidden_layers")
    if not isinstance(n, int):
        return
    prefix = arch.layer_prefix + "."
    held = {int(i) for name in ckpt.names() if name.startswith(prefix)
            and (i := name[len(prefix):].split(".", 1)[0]).isdigit()}
    if missing := sorted(set(range(n)) - held):
        raise UserError(f"{ckpt.path}: config.json counts {n} layers but the weights hold no layer {missing[0]}",
                        "download the missing shards, or repair num_hidden_layers in config.json")


def awq_architecture(ckpt: Checkpoint) -> None:
    from .calibration.archs import awq_arch_for

    awq_arch_for(arch_for(ckpt.model_type).model_type)
    layers_present(ckpt)


def gguf_architecture(ckpt: Checkpoint) -> None:
    from .gguf.model import gguf_arch_for

    gguf_arch_for(arch_for(ckpt.model_type))
    layers_present(ckpt)


def exl3_architecture(ckpt: Checkpoint) -> None:
    from .exl3.converter import EXL3_ARCHS, exl3_refusal

    model_type = arch_for(ckpt.model_type).model_type
    if (why := exl3_refusal(model_type)) is not None:
        raise UserError(f"--target exl3 cannot convert architecture {model_type!r} ({why})",
                        f"exllamav3 converts: {', '.join(EXL3_ARCHS)}; use --target gguf or vllm for this base")
    layers_present(ckpt)


def mlx_architecture(ckpt: Checkpoint) -> None:
    from .mlx import require_mlx
    from .mlx.archs import mlx_arch_for

    mlx_arch_for(arch_for(ckpt.model_type).model_type)
    layers_present(ckpt)
    require_mlx()


@dataclass(frozen=True)
class ExportTarget:
    name: str
    summary: str
    modes: tuple[str, ...]  # --adapters values it writes
    options: tuple[str, ...]  # fields of TARGET_OPTIONS it honours
    writer: str  # "module:function" under tuneport.convert, called as writer(options, progress)
    checks: tuple[Callable[[Checkpoint], None], ...] = (unquantized,)  # what the base must be (raise UserError)
    instead: tuple[tuple[str, str], ...] = ()  # (option it does not honour, what to use instead)


TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    ExportTarget(
        "safetensors", "one merged Hugging Face directory (every engine loads it)", ("merge",), ("dtype",),
        "export_hf:export_safetensors"),
    ExportTarget(
        "vllm", "merged model, or the base plus vLLM-ready adapter directories and their launch command",
        ("merge", "separate"), ("dtype", "max_lora_rank"), "export_vllm:export_vllm",
        checks=(unquantized, known_architecture)),
    ExportTarget(
        "gguf", "llama.cpp / Ollama: a model per --quant type, GGUF LoRAs with --adapters separate, Modelfiles",
        ("merge", "separate"), ("quant", "bpe_pre", "name", "calib", "calib_samples", "calib_seqlen",
                                "accept_config_keys", "accept_tokenizer_difference"),
        "gguf.export:export_gguf", checks=(unquantized, gguf_architecture),
        instead=(("dtype", "choose the GGUF type with --quant (f32, bf16, f16, q8_0, ...)"),)),
    ExportTarget(
        "awq", "vLLM 4-bit (W4A16, activation-aware): compressed-tensors or AutoAWQ GEMM; adapters merged "
        "or served over it", ("merge", "separate"),
        ("dtype", "max_lora_rank", "quant_format", "group_size", "symmetric", "ignore", "calib", "calib_samples",
         "calib_seqlen"), "awq.export:export_awq", checks=(unquantized, awq_architecture)),
    ExportTarget(
        "mlx", "MLX LM (Apple Silicon; mlx[cpu] on Linux): merged or base + mlx-lm adapters, --quant as "
        "mlx-lm's own quantizer", ("merge", "separate"), ("dtype", "quant", "group_size", "accept_config_keys"),
        "mlx.export:export_mlx", checks=(unquantized, mlx_architecture)),
    ExportTarget(
        "exl3", "ExLlamaV3 / TabbyAPI (CUDA): adapters merged, converted by exllamav3's converter, every layer "
        "decoded and checked by tuneport", ("merge",), ("dtype", "bits", "head_bits", "codebook", "work_dir",
                                                        "dry_run"),
        "exl3.export:export_exl3", checks=(unquantized, exl3_architecture)),
)}


def target_for(name: str) -> ExportTarget:
    try:
        return TARGETS[name]
    except KeyError:
        raise UserError(f"unknown --target {name!r}", f"use one of {', '.join(TARGETS)}") from None


def check_base(ckpt: Checkpoint, target: str) -> Checkpoint:
    """Raise the first reason ``target`` cannot be exported from ``ckpt`` (exporters and ``inspect`` ask this);
    the checkpoint the target exports (``for_target``)."""
    ckpt = for_target(ckpt, target)
    for check in TARGETS[target].checks if target in TARGETS else (unquantized,):
        check(ckpt)
    return ckpt


def for_target(ckpt: Checkpoint, target: str) -> Checkpoint:
    """The checkpoint ``target`` exports: a multimodal one's text model for text-only targets (refused by the
    others with the reason)."""
    from .multimodal import (
        FULL_TARGETS,
        MULTIMODAL_REFUSAL,
        TEXT_ONLY_TARGETS,
        TEXT_TOWERS,
        text_tower_view,
    )

    if ckpt.model_type not in TEXT_TOWERS or target in FULL_TARGETS:
        return ckpt
    if target not in TEXT_ONLY_TARGETS:
        raise UserError(f"--target {target} does not export multimodal {ckpt.model_type} checkpoints: "
                        f"{MULTIMODAL_REFUSAL}",
                        f"tuneport merge keeps the whole model; --target {' or '.join(TEXT_ONLY_TARGETS)} export "
                        "its text model")
    return text_tower_view(ckpt)


def base_refusal(ckpt: Checkpoint, target: str) -> str | None:
    """Why ``tuneport export --target TARGET`` would refuse this base, or None when it would run."""
    try:
        check_base(ckpt, target)
    except UserError as e:
        return e.line()
    return None


def check_target_options(opts: ExportOptions) -> None:
    """Refuse options the target does not honour (never ignore them) and adapter modes it cannot write."""
    target = target_for(opts.target)
    for key, (flag, unset) in TARGET_OPTIONS.items():
        if key not in target.options and getattr(opts, key) != unset:
            users = [t.name for t in TARGETS.values() if key in t.options]
            hint = dict(target.instead).get(key) or f"drop it ({flag} is for --target {', '.join(users)})"
            raise UserError(f"{flag} does not apply to --target {target.name}", hint)
    if opts.adapter_mode not in target.modes:
        others = [t.name for t in TARGETS.values() if opts.adapter_mode in t.modes]
        raise UserError(f"--target {target.name} writes --adapters {' or '.join(target.modes)} only",
                        f"use --adapters {target.modes[0]}, or --target {' or '.join(others)}")


