"""``tuneport inspect``: what a path is and which engines can load it as is (with the reason for each no)."""

from __future__ import annotations

import json
from pathlib import Path

from tuneport.convert.adapter import Adapter, load_adapter
from tuneport.convert.adapter_config import config_refusals, read_adapter_config, unquantized_name
from tuneport.convert.arch import ARCHS, ArchSpec, known_arch
from tuneport.convert.checkpoint import Checkpoint, user_path
from tuneport.convert.errors import UserError
from tuneport.convert.gguf.lora import lora_refusals
from tuneport.convert.gguf.model import GGUF_ARCHS, gguf_arch_for
from tuneport.convert.gguf.read import gguf_field, is_lora, open_gguf
from tuneport.convert.manifest import MANIFEST
from tuneport.convert.mlx.read import (
    hf_engines_refusal,
    is_mlx_adapter,
    mlx_adapter_info,
    mlx_lm_refusal,
    mlx_model_info,
    mlx_weights,
)
from tuneport.convert.targets import TARGETS, base_refusal
from tuneport.convert.vllm_rules import preflight

# Every verdict below comes from the rule functions the exporters and preflights use themselves
# (base_refusal, lora_refusals, preflight), so inspect and export cannot disagree.
EXL3_MODEL = "ExLlamaV3 loads EXL3 only: tuneport export --target exl3 (on a CUDA host)"
EXL3_ADAPTER = ("applied at run time over its EXL3 base, rewritten for exllamav3's LoRA loader "
                "(tuneport serve --engine exllamav3 --adapter NAME=PATH, on CUDA)")
EXL3_ONLY = "an EXL3 model: ExLlamaV3 (CUDA) is the engine that loads it"
MLX_ADAPTER = ("an mlx-lm adapter (lora_a/lora_b transposed, one scale): export the PEFT adapter it was made from "
               "for this engine")


def _engine(ok: bool, why: str = "") -> dict:
    return {"loads": ok, "reason": why}


def _exl3_adapter_verdict(adapter) -> dict:
    """exllamav3's run-time LoRA: what convert.exl3.adapter refuses (the rule serve applies), else loads."""
    from tuneport.convert.exl3.adapter import MERGE_HINT, refusals

    problems = refusals(adapter)
    return _engine(not problems, f"{'; '.join(problems)}: {MERGE_HINT}" if problems else EXL3_ADAPTER)


def _base_class(cfg: dict) -> str | None:
    """The base model class PEFT recorded (``auto_mapping.base_model_class``), when it is there as a string."""
    mapping = cfg.get("auto_mapping")
    cls = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    return cls if isinstance(cls, str) else None


def _arch_from_adapter(cfg: dict):
    cls = _base_class(cfg) or ""
    for spec in ARCHS.values():
        if cls in spec.hf_classes:
            return spec
    return None


def gguf_lora_verdict(adapter: Adapter, arch: ArchSpec | None) -> str:
    """Why llama.cpp / Ollama cannot load a PEFT adapter, and the export that makes them (when it would run)."""
    if arch is None:
        return ("llama.cpp loads GGUF LoRA files only; the adapter does not name its base architecture, so "
                f"tuneport export --target gguf --adapters separate works only if its base is one of "
                f"{', '.join(sorted(GGUF_ARCHS))}")
    try:
        gguf_arch_for(arch)
    except UserError as e:
        return f"llama.cpp loads GGUF LoRA files only, and {e.line()}"
    problems = lora_refusals(adapter, None, arch)
    if problems:
        return "llama.cpp loads GGUF LoRA files only, and this adapter has no GGUF LoRA form: " + "; ".join(problems)
    # what lora_refusals can only check against the base itself
    touched = {m.module for m in adapter.modules.values()}
    needs = (["the base does not tie its embeddings"] if touched & {arch.embed, arch.lm_head} else []) + (
        ["the embedding layers saved with the adapter equal the base's"]
        if "base_layer" in adapter.replacement_origin.values() else [])
    return ("llama.cpp loads GGUF LoRA files only: tuneport export --target gguf --adapters separate"
            + (f" (works if {' and '.join(needs)})" if needs else ""))


def mlx_lora_verdict(adapter: Adapter, cfg: dict) -> str:
    """What mlx-lm needs instead of a PEFT adapter; checked against its base when the adapter names a local one."""
    from tuneport.convert.mlx.adapters import refusals

    how = "tuneport export --target mlx --adapters separate"
    name = cfg.get("base_model_name_or_path")
    try:
        base = user_path(name) if isinstance(name, str) and name else None
        local = base is not None and (base / "config.json").is_file()
    except UserError:  # a name no file system takes
        local = False
    if not local:
        return f"mlx-lm loads mlx-lm adapters only: {how} (it checks the adapter against the base)"
    try:
        ck = Checkpoint(base)
        problems = [r for r in (base_refusal(ck, "mlx"),) if r] or refusals(adapter, ck)
    except UserError as e:
        problems = [e.line()]
    if problems:
        return "mlx-lm loads mlx-lm adapters only, and this one has no mlx-lm form: " + "; ".join(problems)
    return f"mlx-lm loads mlx-lm adapters only: {how}"


def inspect_adapter(path: Path) -> dict:
    cfg = read_adapter_config(path)
    refusals = config_refusals(cfg)
    if refusals:
        return {"kind": "peft-adapter", "path": str(path), "peft_type": cfg.get("peft_type"),
                "r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "unsupported": refusals,
                "engines": {e: _engine(False, "; ".join(refusals))
                            for e in ("llama.cpp", "vllm", "exllamav3", "ollama", "mlx")}}
    a = load_adapter(path)
    arch = _arch_from_adapter(cfg)
    modules = {m.module: {"kind": m.kind, "r": m.rank, "alpha": m.alpha, "scale": round(m.scale, 6),
                          "dora": m.magnitude is not None} for m in a.modules.values()}
    pf = preflight(a, arch)
    gguf_reason = gguf_lora_verdict(a, arch)
    engines = {
        "llama.cpp": _engine(False, gguf_reason),
        "vllm": _engine(pf.ok, "; ".join(pf.problems) if pf.problems else
                        ("accepted after lossless fixes: " + "; ".join(pf.fixes) if pf.fixes else "")),
        "exllamav3": _exl3_adapter_verdict(a),
        "ollama": _engine(False, gguf_reason.replace("llama.cpp loads GGUF LoRA files only",
                                                     "Ollama's ADAPTER needs a GGUF LoRA")),
        "mlx": _engine(False, mlx_lora_verdict(a, cfg)),
    }
    return {
        "kind": "peft-adapter",
        "path": str(path),
        "architecture": arch.model_type if arch else _base_class(cfg),
        "base_model": cfg.get("base_model_name_or_path"),
        # a QLoRA adapter names its 4-bit base; tuneport exports over the 16-bit weights
        "base_model_16bit": unquantized_name(cfg.get("base_model_name_or_path")),
        "r": cfg.get("r"),
        "lora_alpha": cfg.get("lora_alpha"),
        "ranks": a.ranks,
        "targets": a.target_suffixes,
        "target_parameters": sorted(cfg.get("target_parameters") or []),  # LoRA on raw parameters (MoE experts)
        "modules_to_save": a.modules_to_save,
        "flags": a.flags(),
        "dtype": str(a.dtype).replace("torch.", ""),
        "parameters": sum(m.A.numel() + m.B.numel() for m in a.modules.values())
        + sum(p.A.numel() + p.B.numel() for p in a.param_loras),
        "bytes": a.file.stat().st_size if a.file else 0,
        "modules": modules,
        "engines": engines,
    }


def _made_by(path: Path) -> dict | None:
    """Who wrote a directory, from its manifest.json (tuneport's exports)."""
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict):
        return None
    return {"tool": m.get("tool"), "target": m.get("target"),
            "adapters": [i.get("name") for i in m.get("inputs", []) if i.get("role") == "adapter"]}


def export_verdicts(ck: Checkpoint) -> dict[str, dict]:
    """For every ``tuneport export --target``: whether it would run on this base, and why not (the exporters'
    own checks)."""
    return {name: {"ok": (why := base_refusal(ck, name)) is None, "reason": why or ""} for name in TARGETS}


def _mlx_engine(ck: Checkpoint, exports: dict[str, dict]) -> dict:
    if not exports["mlx"]["ok"]:
        return _engine(False, f"tuneport cannot export this one to MLX ({exports['mlx']['reason']})")
    as_is = mlx_lm_refusal(ck.config) if ck.format == "safetensors" else "mlx-lm reads safetensors only"
    return _engine(as_is is None, f"{as_is}: tuneport export --target mlx" if as_is else "")


def inspect_exl3_model(ck: Checkpoint) -> dict:
    """An EXL3 directory (exllamav3's converter): bits per layer and codebook, read from its tensors."""
    from tuneport.convert.exl3.read import Exl3Model

    summary = Exl3Model(ck.path).summary()
    engines = {e: _engine(False, EXL3_ONLY) for e in ("llama.cpp", "vllm", "ollama", "mlx")}
    engines["exllamav3"] = _engine(True, "ExLlamaV3 on CUDA, with PEFT adapters at run time: tuneport serve "
                                         "--engine exllamav3 (or TabbyAPI without adapters: --tabby-dir)")
    return {"kind": "exl3-model", "path": str(ck.path), "format": "exl3", "architecture": ck.model_type,
            "hf_architectures": ck.config.get("architectures"), "bytes": ck.nbytes, "files": len(ck.weight_files),
            "vocab_size": ck.config.get("vocab_size"), "quantization": summary, "layers": summary["layers"],
            "made_by": _made_by(ck.path), "tokenizer_files": [f.name for f in ck.side_files()], "engines": engines}


def inspect_model(spec: str) -> dict:
    from tuneport.convert.exl3.read import is_exl3

    ck = Checkpoint(spec)
    if is_exl3(ck.config):
        return inspect_exl3_model(ck)
    arch = known_arch(ck.model_type)
    quant = ck.quantization
    kind = "hf-model"
    made_by = _made_by(ck.path)
    if made_by and made_by["target"] in ("merge", "safetensors", "vllm"):
        kind = "merged-checkpoint"
    weights_4bit = _weight_quantization(ck)
    if quant:
        kind = "quantized-checkpoint"
    vllm_ok = arch is not None or bool(set(ck.config.get("architectures") or []))
    exports = export_verdicts(ck)
    gguf_how = ("tuneport export --target gguf" if exports["gguf"]["ok"]
                else f"tuneport cannot export this one to GGUF ({exports['gguf']['reason']})")
    engines = {
        "llama.cpp": _engine(False, f"llama.cpp loads GGUF only: {gguf_how}"),
        "vllm": _engine(vllm_ok, "" if arch else "architecture not in tuneport's tables; vLLM may still load it"),
        "exllamav3": _engine(False, EXL3_MODEL),
        "ollama": _engine(False, f"Ollama imports GGUF: {gguf_how}"),
        "mlx": _mlx_engine(ck, exports),
    }
    return {
        "kind": kind,
        "path": str(ck.path),
        "architecture": ck.model_type,
        "hf_architectures": ck.config.get("architectures"),
        "supported_by_tuneport": arch is not None,
        "parameters": ck.num_parameters,
        "dtype": str(ck.dtype).replace("torch.", ""),
        "bytes": ck.nbytes,
        "files": len(ck.weight_files),
        "vocab_size": ck.config.get("vocab_size"),
        "tied_embeddings": ck.tied_embeddings,
        "quantization": quant,
        "weight_quantization": weights_4bit,
        "made_by": made_by,
        "tokenizer_files": [f.name for f in ck.side_files()],
        "exports": exports,
        "engines": engines,
    }


def inspect_mlx_model(path: Path, info: dict) -> dict:
    """An MLX LM directory (mlx-lm's layout, maybe quantized by mlx): what mlx-lm runs, and for the others why not."""
    ck = Checkpoint(path)
    weights = mlx_weights(path, {n: ck.meta(n) for n in ck.names()}, ck.config.get("quantization"))
    quant = info["quantization"]
    if quant is not None:
        quant = {**quant, "quantized_modules": weights["quantized_modules"], "per_module": info["per_module"],
                 "bits_used": list(weights["modules_by_bits"]), "modules_by_bits": weights["modules_by_bits"],
                 "unquantized_matrices": weights["unquantized_matrices"]}
    other = hf_engines_refusal(info, ck.model_type)
    gguf = "llama.cpp loads GGUF only: export the original Hugging Face model with tuneport export --target gguf"
    engines = {
        "llama.cpp": _engine(False, gguf),
        "vllm": _engine(other is None, f"vLLM cannot run it: {other}" if other else ""),
        "exllamav3": _engine(False, EXL3_MODEL),
        "ollama": _engine(False, gguf.replace("llama.cpp loads GGUF only", "Ollama imports GGUF")),
        "mlx": _engine(True),
    }
    return {
        "kind": "mlx-model",
        "format": "mlx",
        "path": str(path),
        "architecture": ck.model_type,
        "hf_architectures": ck.config.get("architectures"),
        "parameters": weights["parameters"],
        "dtype": weights["dtype"],
        "bytes": ck.nbytes,
        "files": len(ck.weight_files),
        "vocab_size": ck.config.get("vocab_size"),
        "tied_embeddings": ck.tied_embeddings,
        "quantization": quant,
        "adapters": sorted(p.parent.name for p in path.glob("adapters/*/adapter_config.json")
                           if is_mlx_adapter(p.parent)),
        "made_by": _made_by(path),
        "tokenizer_files": [f.name for f in ck.side_files()],
        "engines": engines,
    }


def inspect_mlx_adapter(path: Path) -> dict:
    """An mlx-lm adapter directory (adapters.safetensors + adapter_config.json)."""
    info = mlx_adapter_info(path)
    engines = {e: _engine(False, MLX_ADAPTER) for e in ("llama.cpp", "vllm", "exllamav3", "ollama")}
    engines["mlx"] = _engine(True, "over the MLX model it was made for (mlx-lm's --adapter-path)")
    return {"kind": "mlx-adapter", "format": "mlx", "path": str(path), **info, "engines": engines}


def _weight_quantization(ck: Checkpoint) -> dict | None:
    """A 4-bit checkpoint in a format tuneport writes (compressed-tensors pack-quantized, AutoAWQ GEMM): its
    scheme and which modules are quantized."""
    from tuneport.convert.awq.formats import FORMATS
    from tuneport.convert.stored.int4 import quant_info

    info = quant_info(ck.quantization or {})
    if info is None:
        return None
    marker = f".{FORMATS[info['format']].marker}"
    modules = sorted(n.removesuffix(marker) for n in ck.names() if n.endswith(marker))
    kinds = sorted({m.rsplit(".", 1)[-1] for m in modules})
    return {**info, "quantized_modules": len(modules), "module_kinds": kinds,
            "kept_16bit": sorted(n.removesuffix(".weight") for n in ck.names()
                                 if n.endswith(".weight") and len(ck.meta(n).shape) == 2)}


def inspect_gguf(path: Path) -> dict:
    r = open_gguf(path)

    def field(name: str):
        return gguf_field(r, name)

    lora = is_lora(r)
    types = sorted({t.tensor_type.name for t in r.tensors})
    engines = {
        "llama.cpp": _engine(True),
        "vllm": _engine(False, "vLLM takes no GGUF LoRA: export the PEFT adapter with tuneport export --target vllm")
        if lora else _engine(True, "experimental in vLLM; prefer the HF model (tuneport export --target vllm)"),
        "exllamav3": _engine(False, "ExLlamaV3 loads EXL3 only"),
        "ollama": _engine(True),
    }
    return {
        "kind": "gguf-lora" if lora else "gguf-model",
        "path": str(path),
        "architecture": field("general.architecture"),
        "tensors": len(r.tensors),
        "parameters": int(sum(int(t.n_elements) for t in r.tensors)),
        "quant_types": types,
        "bytes": path.stat().st_size,
        "chat_template": field("tokenizer.chat_template") is not None,
        "lora_alpha": field("adapter.lora.alpha") if lora else None,
        "engines": engines,
    }


def inspect_path(spec: str) -> dict:
    path = user_path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return inspect_gguf(path)
    if is_mlx_adapter(path):
        return inspect_mlx_adapter(path)
    if (mlx := mlx_model_info(path)) is not None:
        return inspect_mlx_model(path, mlx)
    if path.is_dir() and (path / "adapter_config.json").exists():
        return inspect_adapter(path)
    if path.is_dir() and not (path / "config.json").exists() and any(path.glob("adapter_model.*")):
        read_adapter_config(path)  # raises the clear "no adapter_config.json" error
    return inspect_model(spec)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _mlx_quant_line(q: dict) -> str:
    bits = q["modules_by_bits"]
    width = "/".join(map(str, bits)) if len(bits) > 1 else str(q["bits"])
    line = (f"mlx {q['mode']} {width}-bit{' mixed' if q['per_module'] else ''}, group {q['group_size']}; "
            f"{q['quantized_modules']} modules ({', '.join(f'{b}-bit: {n}' for b, n in bits.items())})")
    if q["per_module"]:
        line += f", {q['per_module']} per-module entries"
    return line + f"; unquantized: {', '.join(q['unquantized_matrices']) or 'none'}"


def _quant_line(r: dict) -> str | None:
    """The quantization of a 4-bit checkpoint tuneport writes or of an MLX directory, in words (None: as is)."""
    if wq := r.get("weight_quantization"):
        return (f"{wq['format']} {wq['bits']}-bit, group {wq['group_size']}, "
                f"{'symmetric' if wq['symmetric'] else 'asymmetric'}; {wq['quantized_modules']} modules "
                f"({', '.join(wq['module_kinds'])}); 16-bit: {', '.join(wq['kept_16bit']) or 'none'}")
    if r["kind"] == "mlx-model":
        return _mlx_quant_line(r["quantization"]) if r["quantization"] else "none"
    if r["kind"] == "exl3-model":
        q = r["quantization"]
        return (f"exl3 {q['bits']} bpw (average over linears {q['average_bits']}), head {q['head_bits']} bits, "
                f"codebook {', '.join(q['codebooks']) or q['codebook']}; {q['quantized_linears']} linears")
    return None


def format_report(r: dict) -> str:
    lines = [f"{r['path']}: {r['kind']}"]
    keys = ["format", "architecture", "base_model", "base_model_16bit", "fine_tune_type", "parameters", "dtype",
            "bytes", "files",
            "vocab_size", "tied_embeddings", "r", "lora_alpha", "ranks", "targets", "modules_to_save", "rank", "scale",
            "num_layers", "layers", "keys", "modules", "quant_types", "tensors", "chat_template", "lora_alpha",
            "quantization", "adapters", "made_by"]
    for k in dict.fromkeys(keys):
        if k == "quantization" and (q := _quant_line(r)) is not None:
            lines.append(f"  {k:16} {q}")
        elif k == "layers" and isinstance(r.get(k), dict):
            lines += [f"  {'layers' if i == 0 else '':16} {g}: {d}" for i, (g, d) in enumerate(r[k].items())]
        elif k in r and r[k] not in (None, [], {}) and not (k == "modules" and isinstance(r[k], dict)):
            v = _size(r[k]) if k == "bytes" else (f"{r[k]:,}" if k == "parameters" else r[k])
            lines.append(f"  {k:16} {v}")
    if r.get("flags"):
        on = {k: v for k, v in r["flags"].items() if v not in (False, None, {}, [], "none")}
        lines.append(f"  {'flags':16} {on or 'none'}")
    if isinstance(r.get("modules"), dict) and r["modules"]:
        scales = sorted({(m['r'], m['alpha'], m['scale']) for m in r["modules"].values()})
        lines.append(f"  {'scales':16} " + ", ".join(f"r={a} alpha={b:g} -> {c:g}" for a, b, c in scales))
    if exports := r.get("exports"):
        lines.append(f"  {'exports':16} " + (", ".join(t for t, e in exports.items() if e["ok"]) or "none"))
        lines += [f"  {'':16} not {t}: {e['reason']}" for t, e in exports.items() if not e["ok"]]
    for name, e in r.get("engines", {}).items():
        mark = "yes" if e["loads"] else "no "
        lines.append(f"  {name:10} {mark}  {e['reason']}".rstrip())
    return "\n".join(lines)
