"""``export --target awq``: a complete 4-bit HF directory vLLM loads (compressed-tensors or AutoAWQ GEMM),
adapters merged before quantizing, or written beside the quantized base for vLLM to serve over it."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..arch import arch_for
from ..atomic import atomic_dir
from ..calibration.archs import awq_arch_for, dense_layers_refusal
from ..calibration.blocks import NOT_WEIGHTS, BlockPass
from ..calibration.hooks import hooked_modules
from ..calibration.layouts import FUSED_SETS
from ..calibration.text import load_calibration
from ..checkpoint import Checkpoint
from ..cpu_features import w4a16_cpu_problem
from ..errors import UserError
from ..experts import expert_tensor
from ..export_hf import copy_side_files
from ..export_vllm import LAUNCH_SH, check_for_vllm, launch_args, write_launch, write_vllm_adapter
from ..inputs import Progress, open_inputs
from ..load_check import check_adapter_dirs, check_hf_dir
from ..manifest import input_entries, write_manifest
from ..merge import CONFIG_DTYPE_NAMES, MergePlan, WeightedAdapter, merge_one, plan_merge
from ..multimodal import vllm_name
from ..options import ExportOptions, ExportResult, model_name
from ..shards import ShardedSafetensorsWriter
from ..tensors import TensorMeta
from ..vllm_rules import float16_refusal, round_lora_rank, vllm_config_updates
from .adapters import SCALES_FILE, mark_rescaled, rescale_adapter, scales_digest, write_scales
from .core import quantize_block
from .formats import DEFAULT_FORMAT, PACK, AWQFormat, format_for
from .quant import QuantScheme

log = logging.getLogger(__name__)
AWQ_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def output_dtype(opts_dtype: str, fmt: AWQFormat, base_dtype: torch.dtype, model_type: str = "") -> torch.dtype:
    """The 16-bit dtype of the scales and every unquantized tensor: --dtype, else the base's where the format
    stores it, else fp16 (bf16 for the model types vLLM refuses float16 for)."""
    if opts_dtype == "fp32":
        raise UserError("--target awq writes 16-bit activations' scales; --dtype fp32 is not a choice",
                        "use --dtype fp16 or bf16 (vLLM's W4A16 kernels run in 16-bit)")
    no_fp16 = float16_refusal(model_type, f"--target awq --format {fmt.name} --dtype {opts_dtype}")
    if opts_dtype == "auto":
        dtype = base_dtype if base_dtype in fmt.scale_dtypes else torch.float16
        if no_fp16 is not None and dtype == torch.float16:
            dtype = torch.bfloat16
    else:
        dtype = AWQ_DTYPES[opts_dtype]
    if dtype == torch.float16 and no_fp16 is not None:
        raise no_fp16
    if dtype not in fmt.scale_dtypes:
        if no_fp16 is not None:
            raise UserError(f"--format {fmt.name} stores fp16 scales, and vLLM refuses float16 for {model_type}",
                            "use --format compressed-tensors (bf16 scales)")
        raise UserError(f"--format {fmt.name} stores fp16 scales; --dtype {opts_dtype} is not a choice",
                        "use --dtype fp16, or --format compressed-tensors")
    return dtype


def quantized_modules(plan: MergePlan, linears: tuple[str, ...], layer_prefix: str, n_layers: int,
                      scheme: QuantScheme,
                      ignore: list[str]) -> tuple[set[str], list[str], list[str]]:
    """(modules written in 4 bits, modules kept 16-bit by --ignore, modules kept 16-bit by their shape)."""
    try:
        patterns = [re.compile(p) for p in ignore]
    except re.error as e:
        raise UserError(f"--ignore {e.pattern!r} is not a regular expression: {e}", "fix the pattern") from None
    shapes = {s.name: s.shape for s in plan.specs}
    chosen, ignored, unfit = set(), [], []
    per_expert = expert_tensor(plan.base.arch) if plan.base.arch else None
    experts = [s.name.removesuffix(".weight") for s in plan.specs if per_expert and per_expert.match(s.name)]
    for name in [f"{layer_prefix}.{i}.{lin}" for i in range(n_layers) for lin in linears] + experts:
        out_f, in_f = shapes[f"{name}.weight"]
        if any(p.search(name) for p in patterns):
            ignored.append(name)
        elif in_f % scheme.group_size or out_f % PACK:
            unfit.append(name)
        else:
            chosen.add(name)
    kept = set(ignored) | set(unfit)
    for i in range(n_layers):  # vLLM fuses these: a set is quantized as a whole or not at all
        for fused, members in FUSED_SETS.items():
            names = {f"{layer_prefix}.{i}.{m}" for m in members}
            if names & kept and names & chosen:
                raise UserError(f"--ignore keeps {', '.join(sorted(names & kept))} 16-bit but not the rest of "
                                f"{', '.join(members)}, which vLLM fuses into one {fused}",
                                "ignore all of them or none (e.g. --ignore 'self_attn\\.(q|k|v)_proj')")
    layers: dict[str, set[bool]] = {}  # vLLM runs a layer's experts as one fused MoE: all 4-bit or none
    for name in experts:
        layers.setdefault(name.split(".experts.")[0], set()).add(name in chosen)
    if mixed := sorted(block for block, kinds in layers.items() if len(kinds) > 1):
        raise UserError(f"{mixed[0]}: some experts would be 4-bit and others 16-bit (--ignore, or widths that do not "
                        f"fit --group-size {scheme.group_size}), but vLLM runs a layer's experts as one fused module",
                        "ignore all of a layer's experts or none, or pass a --group-size every expert fits")
    return chosen, ignored, unfit


def fused_names(kept: list[str]) -> list[str]:
    """vLLM's names for fused sets whose members are all kept 16-bit ("model.layers.0.self_attn.qkv_proj"):
    older vLLM matches AutoAWQ's modules_to_not_convert against the fused module's name."""
    out = []
    for fused, members in FUSED_SETS.items():
        blocks = sorted({k[: -len(members[0])] for k in kept if k.endswith("." + members[0])})
        out += [b + fused for b in blocks if all(b + m in kept for m in members)]
    return out


def output_specs(plan: MergePlan, quantized: set[str], fmt: AWQFormat, scheme: QuantScheme,
                 dtype: torch.dtype) -> list[TensorMeta]:
    specs: list[TensorMeta] = []
    for s in plan.specs:
        if s.name.endswith(NOT_WEIGHTS):
            continue
        module = s.name.removesuffix(".weight")
        if s.name.endswith(".weight") and module in quantized:
            out_f, in_f = s.shape
            specs += [TensorMeta(n, d, tuple(sh)) for n, (d, sh) in fmt.shapes(out_f, in_f, scheme, module).items()]
        else:
            specs.append(TensorMeta(s.name, dtype if s.dtype.is_floating_point else s.dtype, s.shape))
    return specs


def load_tokenizer(plan: MergePlan):
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="tuneport-tok-") as d:
        copy_side_files(plan, Path(d))
        try:
            return AutoTokenizer.from_pretrained(d)
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"{plan.base.path} has no tokenizer the calibration can use ({str(e)[:120]})",
                            "add the base's tokenizer files (tokenizer.json / tokenizer.model) to it") from None


@dataclass
class Towers:
    """What AWQ quantizes and what it writes: a text model's checkpoint as is, or a multimodal checkpoint's text
    model (calibrated and quantized as that architecture, written under the whole checkpoint's names) plus the
    rest (the vision tower, adapters on it merged, kept 16-bit)."""

    text: Checkpoint
    text_adapters: list[WeightedAdapter]
    rest: MergePlan | None = None  # the whole checkpoint's plan, for the tensors outside the text model
    name: Callable[[str], str] = lambda n: n  # a text-model name as the output writes it
    keep_16bit: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, whole: Checkpoint, adapters: list[WeightedAdapter]) -> Towers:
        """``adapters``: those merged before quantizing (none with --adapters separate)."""
        from ..multimodal import TEXT_TOWERS, split_towers, text_tower_view, whole_checkpoint_namer

        if whole.model_type not in TEXT_TOWERS:
            return cls(whole, adapters)
        parts = [(split_towers(w.adapter, whole.model_type), w.weight) for w in adapters]
        text = text_tower_view(whole)
        text.notes = list(getattr(whole, "notes", []))  # the vision tower is kept
        rest = plan_merge(whole, [WeightedAdapter(v, weight) for (_, v), weight in parts if v is not None])
        return cls(text, [WeightedAdapter(t, weight) for (t, _), weight in parts if t is not None], rest,
                   whole_checkpoint_namer(whole), list(TEXT_TOWERS[whole.model_type].keep_16bit))

    def rest_specs(self, dtype: torch.dtype) -> list[TensorMeta]:
        return [TensorMeta(vllm_name(self.rest.base.model_type, s.name),
                           dtype if s.dtype.is_floating_point else s.dtype, s.shape)
                for s in self._rest()] if self.rest else []

    def rest_tensors(self):
        for s in self._rest() if self.rest else []:
            yield replace(s, name=vllm_name(self.rest.base.model_type, s.name)), merge_one(self.rest, s)

    def _rest(self) -> list[TensorMeta]:
        from ..multimodal import is_vision

        return [s for s in self.rest.specs if is_vision(self.rest.base.model_type, s.name)]

    def config(self, text_config: dict) -> dict:
        """The output's config.json before quantization keys: the text model's, or the whole model's with it."""
        if self.rest is None:
            return text_config
        whole = dict(self.rest.config)
        whole["text_config"] = {**whole.get("text_config", {}), **{
            k: v for k, v in text_config.items() if k in self.text.config and self.text.config[k] != v}}
        return whole


def calibrated_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint AWQ calibrates and quantizes for ``ckpt``: itself, or a multimodal one's text model."""
    return Towers.of(ckpt, []).text


def export_awq(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Quantize (merged) weights block by block and write the HF directory, adapters and launch files."""
    whole, loaded = open_inputs(opts, "awq")
    arch = awq_arch_for(arch_for(whole.model_type).model_type)
    fmt = format_for(opts.quant_format or DEFAULT_FORMAT)
    separate = opts.adapter_mode == "separate"
    if separate and not loaded:
        raise UserError("--adapters separate needs at least one --adapter", "pass --adapter NAME=PATH")
    if not separate and opts.max_lora_rank is not None:
        raise UserError("--max-lora-rank applies to --adapters separate", "drop it, or keep the adapters separate")
    towers = Towers.of(whole, [] if separate else loaded)
    ckpt = towers.text
    if why := dense_layers_refusal(arch, ckpt.config):
        raise UserError(f"AWQ cannot calibrate this model: {why}", "use --target vllm or gguf for this base")
    plan = plan_merge(ckpt, towers.text_adapters)
    results = check_for_vllm(whole, loaded, opts.max_lora_rank) if separate else []
    dtype = output_dtype(opts.dtype, fmt, plan.matrix_dtype, arch_for(whole.model_type).model_type)
    scheme = QuantScheme(4, opts.group_size or 128, opts.symmetric, scale_dtype=dtype)
    layer_prefix = ckpt.arch.layer_prefix
    n_layers = int(plan.config["num_hidden_layers"])
    quantized, ignored, unfit = quantized_modules(plan, arch.linears, layer_prefix, n_layers, scheme, opts.ignore)
    if not quantized:
        raise UserError(f"no linear layer can be written with --group-size {scheme.group_size} "
                        "(input width must divide by it, output width by 8)",
                        "pass a smaller --group-size, or fewer --ignore patterns")
    notes = list(plan.notes)
    if ckpt.arch.experts is not None and (why := w4a16_cpu_problem(
            {**ckpt.config, "quantization_config": fmt.config(scheme, [])})):
        notes.append(f"vLLM's CPU build cannot run this model on this machine ({why}); vLLM on a GPU can")
    if unfit:
        notes.append(f"{len(unfit)} linear(s) kept 16-bit: their widths do not fit --group-size "
                     f"{scheme.group_size} (e.g. {unfit[0]})")
    calib = load_calibration(load_tokenizer(plan), opts.calib, opts.calib_samples, opts.calib_seqlen,
                             plan.config.get("max_position_embeddings"))
    specs = [replace(s, name=towers.name(s.name)) for s in output_specs(plan, quantized, fmt, scheme, dtype)]
    specs += towers.rest_specs(dtype)
    plan_specs = {s.name: s for s in plan.specs}
    total = sum(s.nbytes for s in specs)
    done = 0
    groups: list[dict] = []
    scales: dict[str, dict[str, torch.Tensor]] = {}
    with atomic_dir(opts.out, force=opts.force) as tmp:
        writer = ShardedSafetensorsWriter(tmp, specs, max_shard_bytes=opts.max_shard_bytes)
        try:
            def put(name: str, t: torch.Tensor) -> None:
                nonlocal done
                writer.write(towers.name(name), t)
                done += t.numel() * t.element_size()
                if progress:
                    progress(done, total, name)

            for s in plan.specs:
                if not s.name.startswith(f"{layer_prefix}."):
                    t = merge_one(plan, s)
                    put(s.name, t.to(dtype) if t.is_floating_point() else t)
            for s, t in towers.rest_tensors():  # a multimodal model's vision tower: 16-bit, adapters merged
                writer.write(s.name, t.to(dtype) if t.is_floating_point() else t)
                done += t.numel() * t.element_size()
            bp = BlockPass(plan, arch, calib.ids, hooked_modules(arch))
            for block in bp.blocks():
                res = quantize_block(block, arch, scheme, fmt, quantized, dtype)
                groups += [{"layer": block.index, **g} for g in res.groups]
                scales.update(res.scales)
                for name, t in res.tensors.items():
                    put(name, t)
                missing = [n for n in plan_specs if n.startswith(block.prefix) and not n.endswith(NOT_WEIGHTS)
                           and n not in res.tensors and n.removesuffix(".weight") not in res.quantized]
                if missing:
                    raise RuntimeError(f"block {block.index} did not produce {missing[:3]}")
                del block, res  # before the next block is loaded
            writer.close()
        finally:
            writer.stop()
        hashes = writer.sha256()
        # what adapters trained on the 16-bit base need to be rewritten with (convert.awq.adapters), by output name
        scales = {towers.name(f"{m}.weight").removesuffix(".weight"): v for m, v in scales.items()}
        if scales:
            write_scales(tmp / SCALES_FILE, scales)
        kept = [*ignored, *unfit]
        layout = ckpt.arch.experts
        routers = [f"{layer_prefix}.{i}.{layout.disk_block}.{layout.router}" for i in range(n_layers)] if layout else []
        ignore_names = (["lm_head", *routers, *kept] if fmt.name == "compressed-tensors"
                        else [*routers, *kept, *fused_names(kept)])
        ignore_names = [towers.name(n) if n != "lm_head" else n for n in ignore_names] + towers.keep_16bit
        config = {**towers.config(plan.config), "torch_dtype": CONFIG_DTYPE_NAMES[dtype],
                  "quantization_config": fmt.config(scheme, ignore_names)}
        config.update(vllm_config_updates(config))  # the artifact runs in vLLM
        if "dtype" in plan.base.config:
            config["dtype"] = CONFIG_DTYPE_NAMES[dtype]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_side_files(plan, tmp)
        served = model_name(whole.spec)
        vllm_dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        adapters: dict[str, str] = {}
        fixes: dict[str, list[str]] = {}
        for w, pf in zip(loaded if separate else [], results, strict=False):
            write_vllm_adapter(rescale_adapter(w.adapter, scales), pf, tmp / "adapters" / w.adapter.name)
            if scales:
                mark_rescaled(tmp / "adapters" / w.adapter.name, scales_digest(tmp))
            adapters[w.adapter.name] = f"adapters/{w.adapter.name}"
            fixes[pf.adapter] = pf.fixes
        max_rank = round_lora_rank(max(r for w in loaded for r in w.adapter.ranks)) if adapters else 0
        write_launch(tmp, launch_args(".", served, adapters=adapters, max_rank=max_rank, dtype=vllm_dtype))
        alphas = [g["alpha"] for g in groups]
        details = {
            "format": fmt.name, "bits": scheme.bits, "group_size": scheme.group_size, "symmetric": scheme.symmetric,
            "quantized_modules": len(quantized), "kept_16bit": sorted([*ignored, *unfit]),
            "calibration": calib.describe(),
            "awq": {"groups_scaled": len(groups), "mean_alpha": sum(alphas) / len(alphas) if alphas else None,
                    "mean_loss_vs_rtn": (sum(g["loss_vs_rtn"] for g in groups) / len(groups)) if groups else None},
        }
        options = {"adapters": opts.adapter_mode, "dtype": opts.dtype, "format": fmt.name,
                   "group_size": scheme.group_size, "symmetric": scheme.symmetric, "ignore": opts.ignore,
                   "calib": str(opts.calib) if opts.calib else None, "calib_samples": opts.calib_samples,
                   "calib_seqlen": opts.calib_seqlen, "notes": notes}
        if adapters:
            options["max_lora_rank"] = max_rank
        load_check = {"model": check_hf_dir(tmp, tensors=False),
                      "adapters": check_adapter_dirs(tmp, [tmp / p for p in adapters.values()])}
        manifest = write_manifest(tmp, "awq", input_entries(whole, loaded), options,
                                  known_hashes={tmp / p.name: h for p, h in hashes.items()},
                                  extra={**details, "layers": groups, "fixes": fixes, "load_check": load_check})
    return ExportResult(opts.out, "awq", manifest, notes=[*notes, f"serve it with: {opts.out / LAUNCH_SH}"],
                        fixes={k: v for k, v in fixes.items() if v}, details=details)
