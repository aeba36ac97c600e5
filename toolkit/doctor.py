"""``tuneport doctor``: what this machine has for tuneport's engines."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import sys

from tuneport.serve.registry import ENGINES

PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "peft": "peft",
    "safetensors": "safetensors",
    "gguf": "gguf",
    "llama-cpp-python": "llama_cpp",
    "vllm": "vllm",
    "exllamav3": "exllamav3",
    "sentencepiece": "sentencepiece",
    "tokenizers": "tokenizers",
}


def _version(dist: str, module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    for name in (dist, f"{dist}-cpu", module):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "unknown"


def doctor_report() -> dict:
    pkgs = {d: _version(d, m) for d, m in PACKAGES.items()}
    cuda = None
    if pkgs["torch"]:
        import torch

        cuda = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    engines = {}
    for spec in ENGINES.values():  # the engines tuneport serves, from the registry
        dist = next(d for d, m in PACKAGES.items() if m == spec.package)
        engines[spec.label.lower()] = {"engine": spec.name, "available": bool(pkgs[dist]), "version": pkgs[dist],
                                       "reason": "" if pkgs[dist] else spec.install_hint}
    bugs = []
    if pkgs["vllm"]:
        from tuneport.serve.vllm_bugs import bugs_that_apply, vllm_platform

        bugs = [{"key": b.key, "upstream": b.upstream, "platform": vllm_platform(), "mitigation": b.mitigation}
                for b in bugs_that_apply()]
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    from tuneport.convert.cpu import w4a16_cpu_problem

    w4a16 = w4a16_cpu_problem()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "packages": pkgs,
        "cuda": cuda,
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
        "engines": engines,
        "vllm_known_bugs": bugs,
        "vllm_w4a16_cpu": {"ok": w4a16 is None, "reason": w4a16 or ""},
    }


def format_doctor(r: dict) -> str:
    lines = [f"python {r['python']} on {r['platform']}, {r['cpus']} CPUs"
             + (f", {r['memory_bytes'] / 2**30:.1f} GiB" if r["memory_bytes"] else "")]
    cuda = r["cuda"]
    lines.append("cuda: " + ("not checked (no torch)" if cuda is None else
                             (f"yes {cuda['devices']}" if cuda["available"] else "no")))
    for name, v in r["packages"].items():
        lines.append(f"  {name:18} {v or '-'}")
    for name, e in r["engines"].items():
        lines.append(f"engine {name:10} {'ok' if e['available'] else 'no'} {e['reason']}".rstrip())
    for b in r.get("vllm_known_bugs", []):
        lines.append(f"vLLM known bug on {b['platform']}: {b['key']} ({b['upstream']}); "
                     f"tuneport serve works around it ({b['mitigation']})")
    w4 = r.get("vllm_w4a16_cpu") or {"ok": True}
    lines.append("vLLM 4-bit (AWQ/compressed-tensors) on this CPU: "
                 + ("ok (AVX-512)" if w4["ok"] else f"no: {w4['reason']}"))
    return "\n".join(lines)
