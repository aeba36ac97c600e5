"""``tuneport inspect``: what a path is and which engines can load it as is (with the reason for each no)."""

from __future__ import annotations

import json
from pathlib import Path

from tuneport.convert.adapter import Adapter, config_refusals, load_adapter, read_adapter_config
from tuneport.convert.arch import ARCHS, ArchSpec, known_arch
from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.errors import UserError
from tuneport.convert.export import base_refusal
from tuneport.convert.gguf.lora import lora_refusals
from tuneport.convert.gguf.model import GGUF_ARCHS, gguf_arch_for
from tuneport.convert.gguf.read import gguf_field, is_lora, open_gguf
from tuneport.convert.manifest import MANIFEST
from tuneport.convert.vllm_rules import preflight

# Every verdict below comes from the rule functions the exporters and preflights use themselves
# (base_refusal, lora_refusals, preflight), so inspect and export cannot disagree.
EXL3_MODEL = ("ExLlamaV3 loads EXL3 only, which this version of tuneport does not write "
              "(exllamav3's own converter takes an unquantized HF directory)")
EXL3_ADAPTER = "TabbyAPI's exllamav3 backend loads no LoRA: merge it first (tuneport merge)"


def _engine(ok: bool, why: str = "") -> dict:
    return {"loads": ok, "reason": why}


def _arch_from_adapter(cfg: dict):
    cls = (cfg.get("auto_mapping") or {}).get("base_model_class", "")
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


def inspect_adapter(path: Path) -> dict:
    cfg = read_adapter_config(path)
    refusals = config_refusals(cfg)
    if refusals:
        return {"kind": "peft-adapter", "path": str(path), "peft_type": cfg.get("peft_type"),
                "r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "unsupported": refusals,
                "engines": {e: _engine(False, "; ".join(refusals))
                            for e in ("llama.cpp", "vllm", "exllamav3", "ollama")}}
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
        "exllamav3": _engine(False, EXL3_ADAPTER),
        "ollama": _engine(False, gguf_reason.replace("llama.cpp loads GGUF LoRA files only",
                                                     "Ollama's ADAPTER needs a GGUF LoRA")),
    }
    return {
        "kind": "peft-adapter",
        "path": str(path),
        "architecture": arch.model_type if arch else (cfg.get("auto_mapping") or {}).get("base_model_class"),
        "base_model": cfg.get("base_model_name_or_path"),
        "r": cfg.get("r"),
        "lora_alpha": cfg.get("lora_alpha"),
        "ranks": a.ranks,
        "targets": a.target_suffixes,
        "modules_to_save": a.modules_to_save,
        "flags": a.flags(),
        "dtype": str(a.dtype).replace("torch.", ""),
        "parameters": sum(m.A.numel() + m.B.numel() for m in a.modules.values()),
        "bytes": a.file.stat().st_size if a.file else 0,
        "modules": modules,
        "engines": engines,
    }


def inspect_model(spec: str) -> dict:
    ck = Checkpoint(spec)
    arch = known_arch(ck.model_type)
    manifest = ck.path / MANIFEST
    quant = ck.quantization
    kind = "hf-model"
    made_by = None
    if manifest.exists():
        try:
            m = json.loads(manifest.read_text())
            made_by = {"tool": m.get("tool"), "target": m.get("target"),
                       "adapters": [i.get("name") for i in m.get("inputs", []) if i.get("role") == "adapter"]}
            if m.get("target") in ("merge", "safetensors", "vllm"):
                kind = "merged-checkpoint"
        except ValueError:
            pass
    weights_4bit = _weight_quantization(ck)
    if quant:
        kind = "quantized-checkpoint"
    vllm_ok = arch is not None or bool(set(ck.config.get("architectures") or []))
    gguf_refusal = base_refusal(ck, "gguf")
    gguf_how = ("tuneport export --target gguf" if gguf_refusal is None
                else f"tuneport cannot export this one to GGUF ({gguf_refusal})")
    engines = {
        "llama.cpp": _engine(False, f"llama.cpp loads GGUF only: {gguf_how}"),
        "vllm": _engine(vllm_ok, "" if arch else "architecture not in tuneport's tables; vLLM may still load it"),
        "exllamav3": _engine(False, EXL3_MODEL),
        "ollama": _engine(False, f"Ollama imports GGUF: {gguf_how}"),
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
        "engines": engines,
    }


def _weight_quantization(ck: Checkpoint) -> dict | None:
    """A 4-bit checkpoint in a format tuneport writes (compressed-tensors pack-quantized, AutoAWQ GEMM): its
    scheme and which modules are quantized."""
    from tuneport.convert.awq.formats import FORMATS, quant_info

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
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return inspect_gguf(path)
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


def format_report(r: dict) -> str:
    lines = [f"{r['path']}: {r['kind']}"]
    keys = ["architecture", "base_model", "parameters", "dtype", "bytes", "files", "vocab_size", "tied_embeddings",
            "r", "lora_alpha", "ranks", "targets", "modules_to_save", "quant_types", "tensors", "chat_template",
            "lora_alpha", "quantization", "made_by"]
    if wq := r.get("weight_quantization"):
        keys.remove("quantization")
        lines.append(f"  {'quantization':16} {wq['format']} {wq['bits']}-bit, group {wq['group_size']}, "
                     f"{'symmetric' if wq['symmetric'] else 'asymmetric'}; {wq['quantized_modules']} modules "
                     f"({', '.join(wq['module_kinds'])}); 16-bit: {', '.join(wq['kept_16bit']) or 'none'}")
    for k in dict.fromkeys(keys):
        if k in r and r[k] not in (None, [], {}):
            v = _size(r[k]) if k == "bytes" else (f"{r[k]:,}" if k == "parameters" else r[k])
            lines.append(f"  {k:16} {v}")
    if r.get("flags"):
        on = {k: v for k, v in r["flags"].items() if v not in (False, None, {}, [], "none")}
        lines.append(f"  {'flags':16} {on or 'none'}")
    if r.get("modules"):
        scales = sorted({(m['r'], m['alpha'], m['scale']) for m in r["modules"].values()})
        lines.append(f"  {'scales':16} " + ", ".join(f"r={a} alpha={b:g} -> {c:g}" for a, b, c in scales))
    for name, e in r.get("engines", {}).items():
        mark = "yes" if e["loads"] else "no "
        lines.append(f"  {name:10} {mark}  {e['reason']}".rstrip())
    return "\n".join(lines)
