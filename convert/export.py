"""The two entry points ``merge`` and ``export``: the options checked against the target table
(``targets``), then the target's writer called."""

from __future__ import annotations

import importlib
from pathlib import Path

from .inputs import Progress
from .options import ExportOptions, ExportResult, MergeOptions, coerce_options
from .targets import check_target_options, target_for


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
    check_target_options(opts)
    module, func = target_for(opts.target).writer.split(":")
    writer = getattr(importlib.import_module(f"{__package__}.{module}"), func)
    with accepting(opts.accept_config_keys):
        return writer(opts, progress)


def cached_export(base: Path, target: str, **fields) -> Path:
    """``base`` (an HF directory) exported for ``target`` with ``fields`` once, then reused: cached by the
    options and the base's content (config and tokenizer files, the weight files' size and mtime)."""
    import hashlib

    from .cache import cache_dir
    from .checkpoint import Checkpoint

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
