"""``tuneport doctor``: what this machine has for tuneport's engines."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

from tuneport.convert.mlx import INSTALL_HINT as MLX_INSTALL_HINT
from tuneport.serve.policy.hardware import apple_silicon
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
    "mlx": "mlx",
    "mlx-lm": "mlx_lm",
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


MLX_CHECK_TIMEOUT_S = 120


def mlx_probe() -> dict:
    """Run in a child process by :func:`mlx_status`: import mlx and mlx-lm, quantize a small array as ``export
    --target mlx`` does, and name the device mlx computes on."""
    import mlx.core as mx
    import mlx_lm  # noqa: F401  (export --target mlx and serve --engine mlx need it)

    w = mx.arange(4 * 64, dtype=mx.float32).reshape(4, 64) / 256
    packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
    err = float(mx.abs(mx.dequantize(packed, scales, biases, group_size=64, bits=4) - w).max().item())
    device = mx.default_device()
    return {"device": "gpu (Metal)" if device.type == mx.gpu else "cpu", "metal": bool(mx.metal.is_available()),
            "quantize_error": err}


def mlx_status(pkgs: dict[str, str | None]) -> dict:
    """Whether mlx works here: its versions, a quantization run in a child process (a broken native build
    cannot take doctor down), the device, and what that enables."""
    serves = any(spec.package in ("mlx", "mlx_lm") for spec in ENGINES.values())
    out = {"mlx": pkgs["mlx"], "mlx_lm": pkgs["mlx-lm"], "usable": False, "device": None, "reason": "",
           "export": False, "serve": False}
    if not (pkgs["mlx"] and pkgs["mlx-lm"]):
        missing = " and ".join(n for n in ("mlx", "mlx-lm") if not pkgs[n])
        return {**out, "reason": f"{missing} not installed: {MLX_INSTALL_HINT}"}
    code = "import json; from tuneport.toolkit.doctor import mlx_probe; print(json.dumps(mlx_probe()))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=MLX_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {**out, "reason": f"importing mlx and quantizing 256 numbers took over {MLX_CHECK_TIMEOUT_S} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {**out, "reason": f"mlx does not run here: {last[:200]}"}
    try:
        probe = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {**out, "reason": f"the mlx check printed no result ({proc.stdout.strip()[-200:]!r})"}
    if not probe["quantize_error"] < 0.05:
        return {**out, **probe, "reason": f"mx.quantize round trip is off by {probe['quantize_error']:.3g}"}
    return {**out, **probe, "usable": True, "export": True, "serve": serves,
            "reason": "" if serves else "this version of tuneport has no serve --engine mlx"}


def llamacpp_status(version: str | None, cuda: dict | None) -> dict | None:
    """What the loaded llama.cpp computes on (CPU, CUDA, Metal, Vulkan, ...), its devices, the --gpu-layers
    default that follows, and how to build llama-cpp-python for a GPU this machine has but the build lacks."""
    if not version:
        return None
    from tuneport.convert.gguf.gpu import BACKEND_BUILDS, llamacpp_compute

    try:
        compute = llamacpp_compute()
    except (OSError, AttributeError) as e:  # a library that does not load: say why, doctor goes on
        return {"backend": None, "reason": f"llama-cpp-python does not load: {e}"}
    import llama_cpp

    from tuneport.serve.engines.llamacpp_seq_lora import batching_label, seq_lora

    seq = seq_lora(llama_cpp)
    batched = seq is not None
    out = {**compute.to_dict(), "default_gpu_layers": "all" if compute.gpu_offload else 0, "build_hint": "",
           "adapter_batching": batching_label(seq),
           "adapter_batching_hint": "" if batched else (
               "requests for different adapters decode in one batch with tuneport's llama-cpp-python: "
               "`tuneport llama-wheel --install` builds and installs it (5-14 min; CMAKE_ARGS passes through, "
               "e.g. CMAKE_ARGS=-DGGML_CUDA=on)")}
    wanted = ("CUDA" if cuda and cuda.get("available") and not cuda.get("hip") else
              "Metal" if apple_silicon() else None)
    if wanted and compute.gpu_backend != wanted:
        out["build_hint"] = f"this machine has a {wanted} GPU the llama.cpp build cannot use: {BACKEND_BUILDS[wanted]}"
    return out


def doctor_report() -> dict:
    pkgs = {d: _version(d, m) for d, m in PACKAGES.items()}
    cuda = None
    if pkgs["torch"]:
        import torch

        cuda = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                "hip": getattr(torch.version, "hip", None),
                "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    engines = {}
    for spec in ENGINES.values():  # the engines tuneport serves, from the registry
        dist = next((d for d, m in PACKAGES.items() if m == spec.package), spec.package)
        pkgs.setdefault(dist, _version(dist, spec.package))
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
    from tuneport.convert.cpu_features import w4a16_cpu_problem

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
        "mlx": mlx_status(pkgs),
        "llamacpp": llamacpp_status(pkgs["llama-cpp-python"], cuda),
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
    mlx = r.get("mlx")
    if mlx:
        lines.append(_mlx_line(mlx))
    lc = r.get("llamacpp")
    if lc:
        lines.append(_llamacpp_line(lc))
    return "\n".join(lines)


def _llamacpp_line(lc: dict) -> str:
    if lc.get("backend") is None:
        return f"llama.cpp: no: {lc['reason']}"
    gpus = [f"{d['name']} ({d['description']}, {d['total_bytes'] / 2**30:.1f} GiB)" for d in lc["devices"]
            if d["kind"] in ("gpu", "igpu")]
    line = (f"llama.cpp backend: {lc['backend']}" + (f" on {', '.join(gpus)}" if gpus else "")
            + f"; serve/verify default --gpu-layers {lc['default_gpu_layers']}; adapters batched: "
            + lc["adapter_batching"])
    line += f"\n  {lc['build_hint']}" if lc["build_hint"] else ""
    return line + (f"\n  {lc['adapter_batching_hint']}" if lc["adapter_batching_hint"] else "")


def _mlx_line(m: dict) -> str:
    if not m["usable"]:
        return f"mlx: no: {m['reason']}"
    works = "export --target mlx and serve --engine mlx work" if m["serve"] else "export --target mlx works"
    return (f"mlx: ok, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, on {m['device']}: {works} here"
            + (f" ({m['reason']})" if m["reason"] else ""))
