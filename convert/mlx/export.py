"""``export --target mlx``: a directory mlx-lm loads as is, written one tensor at a time.

Merged (default): the fine-tune folded into the weights in fp32 (``convert.merge``), then cast and, with
``--quant``, quantized by ``mlx.core.quantize`` exactly as ``mlx_lm.convert`` would. Separate: the base
the same way, plus one mlx-lm adapter per PEFT adapter under ``adapters/<name>/``. The config is what
mlx-lm reads (``archs``); before the directory is handed over, mlx-lm builds the model from it and loads
every weight and adapter (lazily: names, shapes, config), so a directory it cannot load never leaves
with exit 0.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..atomic import atomic_dir
from ..errors import UserError
from ..experts import expert_groups
from ..export_hf import copy_side_files
from ..inputs import Progress, open_inputs
from ..manifest import input_entries, write_manifest
from ..merge import CONFIG_DTYPE_NAMES, OUT_DTYPES, MergePlan, merge_one, plan_merge
from ..options import ExportOptions, ExportResult
from ..shards import write_tensors
from ..split_linears import Part, tensor_parts
from ..tensors import TensorMeta
from .adapters import MlxAdapter, mlx_adapter, write_mlx_adapter
from .archs import MlxArch, mlx_arch_for, mlx_config
from .config_keys import audit_mlx_config, engine_only_keys, fill_transformers_defaults
from .quant import QuantPlan, group_size_for, quant_type, quantize, quantized_shapes

log = logging.getLogger(__name__)
SERVE_SH = "serve-mlx.sh"
DROPPED = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved; mlx-lm's sanitize drops them
DTYPE_BY_NAME = {v: k for k, v in CONFIG_DTYPE_NAMES.items()}


def output_dtype(plan: MergePlan, dtype: str) -> torch.dtype:
    """What every floating tensor is stored as: --dtype, else the config's dtype (what mlx_lm.convert
    casts to), else the widest matrix dtype."""
    if (wanted := OUT_DTYPES[dtype]) is not None:
        return wanted
    named = plan.base.config.get("torch_dtype") or plan.base.config.get("dtype")
    return DTYPE_BY_NAME.get(named, plan.matrix_dtype)


def tensor_fixes(march: MlxArch, cfg: dict, tied: bool, embed: str, final_norm: str
                 ) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """fp32 corrections where mlx-lm's model computes differently from transformers (see MlxArch)."""
    if march.embed_factor is None:
        return {}
    f = march.embed_factor(cfg)
    if f == 1.0:
        return {}
    fixes = {embed: lambda t: t.float() * f}
    if tied:  # the output projection is the embedding too: the final norm takes the factor back
        fixes[final_norm] = lambda t: (t.float() + march.norm_offset) / f - march.norm_offset
    return fixes


class _Layout:
    """The output tensors of the base: names mlx-lm expects, dtypes, which weights are quantized. A layer's
    experts of one projection become one ``switch_mlp`` tensor ``[E, out, in]``, written once its last expert
    is read."""

    def __init__(self, plan: MergePlan, march: MlxArch, dtype: torch.dtype, qplan: QuantPlan | None,
                 tied: bool) -> None:
        self.plan, self.dtype, self.qplan = plan, dtype, qplan
        self.prefix = march.weight_prefix if march.wrapper else ""  # every tensor's name, as written
        self.sources: list[TensorMeta] = []
        self.specs: list[TensorMeta] = []
        self.quantized: dict[str, dict] = {}  # module -> params
        # expert tensor -> (stacked tensor, its module, index, count)
        self.stacked: dict[str, tuple[str, str, int, int]] = {}
        self.parts: dict[str, list[tuple[str, Part]]] = {}  # fused linear -> its parts (``convert.split_linears``)
        lm_head = f"{plan.base.arch.lm_head}.weight"
        groups = expert_groups(plan.base.arch, plan.base.config, [s.name for s in plan.specs])
        switch = dict(march.switch_mlp)
        arrived: dict[str, int] = {}
        for spec in plan.specs:
            if any(spec.name.endswith(d) for d in DROPPED) or (tied and spec.name == lm_head):
                continue
            self.sources.append(spec)
            if (group := groups.get(spec.name)) is not None:
                block, proj, order = group
                proj, _, suffix = proj.partition(".")  # "gate_proj", or "gate_proj.bias" (gpt-oss)
                module = f"{block}.{march.switch_block}.{switch[proj]}"
                name = f"{module}.{suffix or 'weight'}"
                self.stacked[spec.name] = (name, module, order.index(spec.name), len(order))
                arrived[name] = arrived.get(name, 0) + 1
                if arrived[name] == len(order):  # planned where it is written: after its last expert
                    self._add(name.removesuffix(".weight") if not suffix else name, (len(order), *spec.shape),
                              spec.dtype, weight=not suffix)
                continue
            if (parts := tensor_parts(plan.base.arch, plan.base.config, spec.name)) is not None:
                self.parts[spec.name] = parts  # a fused linear mlx-lm keeps apart
                for part_name, part in parts:
                    weight = part_name.endswith(".weight")
                    self._add(part_name.removesuffix(".weight") if weight else part_name, part.shape(spec.shape),
                              spec.dtype, weight=weight)
                continue
            self._add(spec.name.removesuffix(".weight") if spec.name.endswith(".weight") else spec.name,
                      spec.shape, spec.dtype, weight=spec.name.endswith(".weight"))

    def _add(self, module: str, shape: tuple[int, ...], src_dtype: torch.dtype, weight: bool = True) -> None:
        floating = src_dtype.is_floating_point
        name = f"{module}.weight" if weight else module
        params = self.qplan.params(module, shape) if (self.qplan and floating and weight) else None
        if params is None:
            self.specs.append(TensorMeta(name, self.dtype if floating else src_dtype, shape))
            return
        self.quantized[module] = params
        for suffix, (qshape, kind) in quantized_shapes(shape, params).items():
            st = {"packed": torch.uint32, "scale": torch.uint8, "float": self.dtype}[kind]
            self.specs.append(TensorMeta(f"{module}.{suffix}", st, qshape))


def write_model(plan: MergePlan, out: Path, layout: _Layout, fixes: dict, max_shard_bytes: int,
                progress: Progress | None) -> dict[Path, str]:
    """Stream the tensors of ``layout`` into ``out``; at most one tensor (and its quantized parts) in memory,
    or for stacked experts one layer's experts of one projection."""
    from .arrays import to_mx, to_torch

    pending: dict[str, dict[int, torch.Tensor]] = {}

    def emit(module: str, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if (params := layout.quantized.get(module)) is None:
            yield name, t
            return
        for suffix, part in quantize(to_mx(t), params).items():
            yield f"{module}.{suffix}", to_torch(part)

    def produce(spec: TensorMeta) -> Iterator[tuple[str, torch.Tensor]]:
        t = merge_one(plan, spec)
        if (fix := fixes.get(spec.name)) is not None:
            t = fix(t)
        if t.dtype.is_floating_point:
            t = t.to(layout.dtype)
        if (stacked := layout.stacked.get(spec.name)) is not None:
            name, module, index, count = stacked
            experts = pending.setdefault(name, {})
            experts[index] = t
            if len(experts) == count:
                del pending[name]
                t = torch.stack([experts[e] for e in range(count)])
                yield from (emit(module, name, t) if name.endswith(".weight") else [(name, t)])
            return
        for name, part in layout.parts.get(spec.name, ()):
            yield from emit(name.removesuffix(".weight"), name, part.rows(t))
        if spec.name not in layout.parts:
            yield from emit(spec.name.removesuffix(".weight"), spec.name, t)

    def named(spec: TensorMeta) -> Iterator[tuple[str, torch.Tensor]]:  # under a wrapper's prefix (else "")
        return ((layout.prefix + name, t) for name, t in produce(spec))

    specs = [TensorMeta(layout.prefix + s.name, s.dtype, s.shape) for s in layout.specs]
    return write_tensors(out, specs, layout.sources, named, max_shard_bytes=max_shard_bytes,
                         progress=progress, metadata={"format": "mlx"})


def check_loads(model_dir: Path, adapter_dirs: list[Path]) -> None:
    """Build the model with mlx-lm from ``model_dir`` and load every weight and adapter (lazily)."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    for adapter in [None, *adapter_dirs]:
        try:
            model, _ = load_model(model_dir, lazy=True, strict=True)
            if adapter is not None:
                load_adapters(model, str(adapter))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            what = f"adapter {adapter.name}" if adapter else "the model"
            raise UserError(f"mlx-lm cannot load {what} tuneport wrote: {e}",
                            "this is a tuneport bug: please report it with the base's config.json") from e


def convert_adapters(plan: MergePlan, loaded) -> list[MlxAdapter]:
    problems, out = [], []
    for w in loaded:
        plan_merge(plan.base, [w])  # the adapter must fit this base first
        try:
            out.append(mlx_adapter(w.adapter, plan.base))
        except UserError as e:
            problems.append(e)
    if problems:
        raise UserError("; ".join(e.message for e in problems), problems[0].hint)
    return out


def serve_script(adapters: list[str]) -> str:
    args = ["--model", "."] + (["--adapter-path", f"adapters/{adapters[0]}"] if len(adapters) == 1 else [])
    many = ("# mlx_lm.server reloads the model to switch adapters; `tuneport serve --engine mlx --base . "
            "--adapter NAME=adapters/NAME ...` serves them all over one base.\n") if len(adapters) > 1 else ""
    return ("#!/usr/bin/env bash\n# Written by tuneport: serves this directory with mlx-lm.\n" + many
            + 'cd "$(dirname "$0")"\nexec python -m mlx_lm server ' + " ".join(map(shlex.quote, args)) + ' "$@"\n')


def export_mlx(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Write an MLX LM directory: merged, or the base plus mlx-lm adapters (``--adapters separate``)."""
    ckpt, loaded = open_inputs(opts, "mlx")
    march = mlx_arch_for(ckpt.model_type)
    separate = opts.adapter_mode == "separate"
    if separate and not loaded:
        raise UserError("--adapters separate needs at least one --adapter", "pass --adapter NAME=PATH")
    q = quant_type(opts.quant) if opts.quant else None
    if q is None and opts.group_size is not None:
        raise UserError("--group-size applies with --quant", "add --quant q4 (or another type), or drop it")
    plan = plan_merge(ckpt, [] if separate else loaded, opts.dtype)
    arch = ckpt.arch
    dtype = output_dtype(plan, opts.dtype)
    cfg, filled = mlx_config(plan.config)
    defaulted = fill_transformers_defaults(cfg)
    audit_notes = audit_mlx_config(cfg)  # a key mlx-lm would silently drop, at a value that changes the model: refused
    dropped = [k for k in engine_only_keys(plan.config) if k in cfg]  # the base's own keys, not tuneport's fixes
    for key in dropped:
        cfg.pop(key)
    # mlx-lm ties (and drops a stored lm_head) by the config; transformers ties when the key is absent
    tied = f"{arch.lm_head}.weight" not in {s.name for s in plan.specs} or bool(
        cfg.get("tie_word_embeddings", True) and not plan.untied)
    cfg["tie_word_embeddings"] = tied
    cfg["torch_dtype"] = CONFIG_DTYPE_NAMES[dtype]
    if "dtype" in cfg:
        cfg["dtype"] = CONFIG_DTYPE_NAMES[dtype]
    qplan = QuantPlan(q, group_size_for(q, opts.group_size), int(cfg["num_hidden_layers"]), arch.layer_prefix,
                      march.quant_predicate) if q else None
    layout = _Layout(plan, march, dtype, qplan, tied)
    fixes = tensor_fixes(march, cfg, tied, f"{arch.embed}.weight", f"{arch.final_norm}.weight")
    converted = convert_adapters(plan, loaded) if separate else []

    notes = list(plan.notes) + [n for a in converted for n in a.notes]
    if filled:
        notes.append(f"config: {', '.join(filled)} written at the top level, where mlx-lm reads them")
    if defaulted:
        notes.append(f"config: {', '.join(defaulted)} written at transformers' default (the base's config.json "
                     "leaves them out, and mlx-lm would assume its own)")
    notes += audit_notes
    if dropped:
        notes.append(f"config: {', '.join(dropped)} left out: mlx-lm reads them, transformers' model does not")
    notes += [f"{arch.model_type}: {n}" for n in march.notes]
    if qplan:
        kept = sorted({m for s in layout.sources if s.dtype.is_floating_point and len(s.shape) == 2
                       and (m := layout.stacked.get(s.name, (s.name.removesuffix(".weight"),))[0])
                       not in layout.quantized})
        if kept:
            notes.append(f"{len(kept)} matrices kept {CONFIG_DTYPE_NAMES[dtype]}: width not a multiple of "
                         f"group size {qplan.group_size} ({kept[0]}{', ...' if len(kept) > 1 else ''})")
    if march.model_type:
        cfg["model_type"] = march.model_type
        notes.append(f"config: model_type {march.model_type}, the name mlx-lm knows {arch.model_type} by")
    with atomic_dir(opts.out, force=opts.force) as tmp:
        hashes = write_model(plan, tmp, layout, fixes, opts.max_shard_bytes, progress)
        if qplan:
            # per-module settings under the paths mlx-lm's tree gives the modules (a wrapper's language_model.)
            cfg["quantization"] = {march.weight_prefix + k if isinstance(v, dict) else k: v
                                   for k, v in qplan.config(layout.quantized).items()}
            cfg["quantization_config"] = cfg["quantization"]
        if march.wrapper:  # the text model's config nested, as mlx-lm's wrapper reads it
            top = {k: cfg.pop(k) for k in ("quantization", "quantization_config") if k in cfg}
            cfg = {"model_type": cfg["model_type"], "text_config": {**cfg, "model_type": arch.model_type}, **top}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        copy_side_files(plan, tmp)
        adapter_dirs = []
        for a in converted:
            write_mlx_adapter(a, tmp / "adapters" / a.name)
            adapter_dirs.append(tmp / "adapters" / a.name)
        (tmp / SERVE_SH).write_text(serve_script([a.name for a in converted]))
        (tmp / SERVE_SH).chmod(0o755)
        check_loads(tmp, adapter_dirs)
        options = {"adapters": opts.adapter_mode, "dtype": CONFIG_DTYPE_NAMES[dtype], "quant": q.name if q else None,
                   "group_size": qplan.group_size if qplan else None, "config_filled": filled,
                   "accept_config_keys": opts.accept_config_keys, "notes": notes}
        extra = {"mlx_adapters": {a.name: a.config() for a in converted}} if converted else None
        manifest = write_manifest(tmp, "mlx", input_entries(ckpt, loaded), options,
                                  known_hashes={tmp / p.name: h for p, h in hashes.items()}, extra=extra)
    details = {"quant": q.name if q else None, "group_size": qplan.group_size if qplan else None,
               "adapters": {a.name: f"adapters/{a.name}" for a in converted}}
    return ExportResult(opts.out, "mlx", manifest, notes=[*notes, f"serve it with: {opts.out / SERVE_SH}"],
                        details=details)
