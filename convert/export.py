"""Every export target as data, and the two entry points ``merge`` and ``export``.

Adding a target means one module (its writer) and one row in ``TARGETS``; the CLI's ``--target`` choices,
the option checks and ``inspect``'s suggestions all come from this table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .arch import arch_for
from .errors import UserError
from .options import AdapterSpec, ExportOptions, ExportResult, MergeOptions, coerce_options

if TYPE_CHECKING:  # the table is imported by the CLI's --help: nothing heavy at import time
    from .adapter import Adapter
    from .checkpoint import Checkpoint
    from .merge import WeightedAdapter

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current item)

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
        from .adapter import unquantized_name

        method = ckpt.quantization.get("quant_method", "an unknown method")
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
    from .awq.archs import awq_arch_for

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
    from .mlx.archs import mlx_arch_for
    from .mlx.export import require_mlx

    mlx_arch_for(arch_for(ckpt.model_type).model_type)
    layers_present(ckpt)
    require_mlx()


@dataclass(frozen=True)
class Target:
    name: str
    summary: str
    modes: tuple[str, ...]  # --adapters values it writes
    options: tuple[str, ...]  # fields of TARGET_OPTIONS it honours
    writer: str  # "module:function" under tuneport.convert, called as writer(options, progress)
    checks: tuple[Callable[[Checkpoint], None], ...] = (unquantized,)  # what the base must be (raise UserError)
    instead: tuple[tuple[str, str], ...] = ()  # (option it does not honour, what to use instead)


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("safetensors", "one merged Hugging Face directory (every engine loads it)", ("merge",), ("dtype",),
           "export_hf:export_safetensors"),
    Target("vllm", "merged model, or the base plus vLLM-ready adapter directories and their launch command",
           ("merge", "separate"), ("dtype", "max_lora_rank"), "export_vllm:export_vllm",
           checks=(unquantized, known_architecture)),
    Target("gguf", "llama.cpp / Ollama: a model per --quant type, GGUF LoRAs with --adapters separate, Modelfiles",
           ("merge", "separate"), ("quant", "bpe_pre", "name", "calib", "calib_samples", "calib_seqlen",
                                   "accept_config_keys", "accept_tokenizer_difference"),
           "gguf.export:export_gguf",
           checks=(unquantized, gguf_architecture),
           instead=(("dtype", "choose the GGUF type with --quant (f32, bf16, f16, q8_0, ...)"),)),
    Target("awq", "vLLM 4-bit (W4A16, activation-aware): compressed-tensors or AutoAWQ GEMM; adapters merged "
           "or served over it", ("merge", "separate"),
           ("dtype", "max_lora_rank", "quant_format", "group_size", "symmetric", "ignore", "calib", "calib_samples",
            "calib_seqlen"), "awq.export:export_awq", checks=(unquantized, awq_architecture)),
    Target("mlx", "MLX LM (Apple Silicon; mlx[cpu] on Linux): merged or base + mlx-lm adapters, --quant as "
           "mlx-lm's own quantizer", ("merge", "separate"), ("dtype", "quant", "group_size", "accept_config_keys"),
           "mlx.export:export_mlx",
           checks=(unquantized, mlx_architecture)),
    Target("exl3", "ExLlamaV3 / TabbyAPI (CUDA): adapters merged, converted by exllamav3's converter, every layer "
           "decoded and checked by tuneport", ("merge",), ("dtype", "bits", "head_bits", "codebook", "work_dir",
                                                           "dry_run"),
           "exl3.export:export_exl3", checks=(unquantized, exl3_architecture)),
)}


def target_for(name: str) -> Target:
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


def load_weighted(adapters: list[AdapterSpec], allow_pickle: bool = False) -> list[WeightedAdapter]:
    from .adapter import load_adapter
    from .merge import WeightedAdapter

    loaded = [WeightedAdapter(load_adapter(a.path, a.name, allow_pickle), a.weight) for a in adapters]
    names = [w.adapter.name for w in loaded]
    if len(set(names)) != len(names):
        raise UserError(f"two adapters share the name {names}", "name them: --adapter NAME=PATH")
    return loaded


def open_inputs(opts: MergeOptions, target: str) -> tuple[Checkpoint, list[WeightedAdapter]]:
    """What every writer starts with: the output path free (or --force), the base opened and fit for
    ``target``, the adapters loaded."""
    from .checkpoint import Checkpoint
    from .io import check_output_path
    from .merge import WeightedAdapter

    check_output_path(opts.out, opts.force)
    ckpt = Checkpoint(opts.base, allow_pickle=opts.allow_pickle)
    view = check_base(ckpt, target)
    loaded = load_weighted(opts.adapters, opts.allow_pickle)
    loaded = [WeightedAdapter(adapter_for(w.adapter, ckpt, view, target), w.weight) for w in loaded]
    return view, loaded


def adapter_for(adapter: Adapter, ckpt: Checkpoint, view: Checkpoint, target: str) -> Adapter:
    """``adapter`` for the checkpoint ``target`` exports (``view``, from ``check_base``): renamed for a
    multimodal model's text view (an adapter on its vision tower refused there)."""
    from .multimodal import text_tower_adapter

    return adapter if view is ckpt else text_tower_adapter(adapter, ckpt.model_type, target)


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


def export(options: ExportOptions | None = None, /, *, progress: Progress | None = None,
           **fields) -> ExportResult:
    """``tuneport export``: an artifact for one engine, written atomically (``target``: see ``TARGETS``).

    Pass an :class:`ExportOptions` or its fields as keywords (``base``, ``target``, ``out``, ``adapters``,
    ``adapter_mode``, ``quant``, ``dtype``, ``max_lora_rank``, ``bpe_pre``, ``name``, ``quant_format``,
    ``group_size``, ``symmetric``, ``ignore``, ``calib``, ``calib_samples``, ``calib_seqlen``, ``bits``,
    ``head_bits``, ``codebook``, ``work_dir``, ``dry_run``, ``accept_config_keys``,
    ``accept_tokenizer_difference``, ``force``, ``allow_pickle``);
    ``progress(done_bytes, total_bytes, item)`` is called as the output is written.
    """
    from .config_audit import accepting

    opts = coerce_options(ExportOptions, options, fields)
    module, func = target_for(opts.target).writer.split(":")
    writer = getattr(importlib.import_module(f"{__package__}.{module}"), func)
    with accepting(opts.accept_config_keys):
        return writer(opts, progress)


def cached_export(base: Path, target: str, **fields) -> Path:
    """``base`` (an HF directory) exported for ``target`` with ``fields`` once, then reused: cached by the
    options and the base's content (config and tokenizer files, the weight files' size and mtime)."""
    import hashlib

    from .checkpoint import Checkpoint
    from .io import cache_dir

    ck = Checkpoint(base)
    h = hashlib.sha256(f"{target}:{sorted(fields.items())}".encode())
    for f in [base / "config.json", *ck.side_files()]:
        h.update(f.name.encode() + f.read_bytes())
    for f in ck.weight_files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_dir() / target / h.hexdigest()[:24]
    if not out.exists():
        export(ExportOptions(base=base, target=target, out=out, **fields))
    return out


def merge(options: MergeOptions | None = None, /, *, progress: Progress | None = None,
          **fields) -> ExportResult:
    """``tuneport merge``: fold adapters into the base and write one HF directory with manifest.json.

    Pass a :class:`MergeOptions` or its fields as keywords (``base``, ``adapters``, ``out``, ``dtype``,
    ``force``, ``allow_pickle``, ``max_shard_bytes``).
    """
    from .export_hf import merge_to_dir

    return merge_to_dir(coerce_options(MergeOptions, options, fields), "merge", progress)
