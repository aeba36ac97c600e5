"""The memory plan per engine and the dry-run report."""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tuneport.convert.errors import UserError
from tuneport.convert.gguf.quant_types import FLOAT_BYTES, GGUF_FOR_DTYPE, QUANT_TYPES

from ..registry import engine_spec
from .artifact import ArtifactInfo
from .choice import FORMAT_LABELS, EngineDecision, ServeLoad
from .hardware import GIB, MIB

# -- memory plan ----------------------------------------------------------------------------------
LLAMACPP_SEQS_PER_CONTEXT = 8  # LlamaCppEngine's n_seq_max: each context holds n_ctx × 8 cells, unified
LLAMACPP_KV_PAD = 256  # llama.cpp rounds a context's KV cells up to a multiple of 256 (measured, 0.3.36)
VLLM_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass
class MemoryPlan:
    """Bytes an engine needs for the load. ``total`` = weights + kv_cache + adapters (device memory: GPU
    for vLLM / ExLlamaV3, RAM for llama.cpp on the CPU); ``host``: adapter copies vLLM keeps in CPU memory, or
    what llama.cpp keeps in RAM beside its offloaded layers; ``per_gpu``: the share of one GPU under
    tensor/pipeline parallelism, or llama.cpp's VRAM with --gpu-layers (None: one device, or none)."""

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


def plan_vllm(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
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


def plan_llamacpp(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    if a.format == "gguf":
        weights, w_how = a.weight_bytes, f"{_n(a.weight_bytes)} bytes of GGUF tensors (mapped from the file)"
    elif a.format == "hf":
        mat = a.params - a.vector_params
        quant = GGUF_FOR_DTYPE[o["dtype"] or "auto"]  # what the llama.cpp backend converts the base to
        nb, label = FLOAT_BYTES[quant], QUANT_TYPES[quant].label
        weights = nb * mat + 4 * a.vector_params
        w_how = (f"{label} GGUF conversion: {nb} × {_n(mat)} matrix params + 4 × {_n(a.vector_params)} "
                 f"F32 norm/bias params = {_n(weights)}")
    else:
        raise UserError(f"llama.cpp cannot load {FORMAT_LABELS.get(a.format, a.format)} weights",
                        "serve it with vLLM, or export GGUF from the unquantized model")
    kvb = o["kv_bytes_per_elem"] or 2
    contexts, seqs = o["contexts"], o["seqs_per_context"]
    cells = math.ceil(load.context_len * seqs / LLAMACPP_KV_PAD) * LLAMACPP_KV_PAD
    kv, kv_how = _kv(a, cells * contexts, kvb, f"{contexts} contexts × {_n(cells)} cells = n_ctx {load.context_len} "
                                              f"× {seqs} sequences, padded to {LLAMACPP_KV_PAD}")
    adapters = sum(o["adapter_bytes"])
    formula = {"weights": w_how, "kv_cache": kv_how + f"; serves up to {contexts * seqs} requests at once; the "
                                                      "first context is allocated at start, the others when "
                                                      "every context is full or busy with other adapter sets",
               "adapters": f"Σ {len(o['adapter_bytes'])} GGUF LoRA sizes (F32: 2× a bf16 PEFT file, "
                           f"1× an fp32 one) = {_n(adapters)}",
               "total": "weights + kv_cache + adapters in RAM (plus llama.cpp's compute buffers)"}
    total = weights + kv + adapters
    if not o["gpu_layers"]:
        return MemoryPlan("llamacpp", weights, kv, adapters, total, 0, None, formula)
    vram, how = _llamacpp_vram(a, o["gpu_layers"], weights, kv, adapters)
    formula["total"] = "weights + kv_cache + adapters: per_gpu in VRAM, host in RAM (plus compute buffers on each)"
    formula["per_gpu"], formula["host"] = how, f"total - per_gpu = {_n(total - vram)}"
    return MemoryPlan("llamacpp", weights, kv, adapters, total, total - vram, vram, formula)


def _llamacpp_vram(a: ArtifactInfo, n_gpu: int, weights: int, kv: int, adapters: int) -> tuple[int, str]:
    """VRAM of llama.cpp's offloaded layers (``n_gpu`` = n_gpu_layers, -1: all): their share of the repeating
    layers' weights, KV cells and LoRA tensors, plus the output layer (the token embeddings stay in RAM)."""
    from tuneport.convert.gguf.gpu import offloaded_layers

    layers, output = offloaded_layers(n_gpu, a.n_layers)
    per_param = weights / max(1, a.params)
    table = int(a.vocab_size * a.hidden_size * per_param)  # the embeddings, and the output layer (or its tied copy)
    per_layer = max(0, weights - 2 * table) / max(1, a.n_layers)
    share = layers / max(1, a.n_layers)
    vram = int(layers * per_layer + (table if output else 0) + share * (kv + adapters))
    spec = "all" if n_gpu < 0 else str(n_gpu)
    return vram, (f"--gpu-layers {spec}: {layers}/{a.n_layers} layers × {_n(int(per_layer))} bytes"
                  + (f" + the output layer {_n(table)}" if output else "")
                  + f" + {layers}/{a.n_layers} of the KV cache and adapters = {_n(vram)}")


MLX_KV_STEP = 256  # mlx-lm's KVCache grows in steps of 256 tokens per request
MLX_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # tuneport --dtype -> bytes of the converted base


def plan_mlx(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    if a.format == "mlx":
        weights, db = a.weight_bytes, a.dtype_bytes
        w_how = f"{_n(weights)} bytes of MLX tensors as stored"
    elif a.format == "hf":
        dtype = o["dtype"] or "auto"
        db = MLX_DTYPE_BYTES.get(dtype, a.dtype_bytes)
        weights = a.params * db
        how = f"--dtype {dtype}" if dtype != "auto" else "--dtype auto: the checkpoint's dtype"
        w_how = f"MLX conversion: {_n(a.params)} params × {db} bytes ({how}) = {_n(weights)}"
    else:
        raise UserError(f"MLX LM cannot load {FORMAT_LABELS.get(a.format, a.format)} weights",
                        "serve it with vLLM, or export MLX from the unquantized model (tuneport export --target mlx)")
    kvb = o["kv_bytes_per_elem"] or db
    per_request = math.ceil(load.context_len / MLX_KV_STEP) * MLX_KV_STEP
    kv, kv_how = _kv(a, per_request * load.concurrency, kvb,
                     f"{load.concurrency} requests × n_ctx {load.context_len} rounded up to {MLX_KV_STEP}")
    adapters = sum(o["adapter_bytes"])
    formula = {"weights": w_how, "kv_cache": kv_how + "; allocated as requests grow, freed when they end",
               "adapters": f"Σ {len(o['adapter_bytes'])} adapters' LoRA matrices in fp32 = {_n(adapters)} (plus the "
                           "zero padding of smaller ranks to the largest rank of each module)",
               "total": "weights + kv_cache + adapters in unified memory (Apple Silicon) or RAM"}
    return MemoryPlan("mlx", weights, kv, adapters, weights + kv + adapters, 0, None, formula)


def memory_plan(engine: str, artifact: ArtifactInfo, load: ServeLoad, *, adapter_bytes: Sequence[int] = (),
                max_lora_rank: int = 16, adapter_slots: int | None = None, kv_bytes_per_elem: int | None = None,
                contexts: int = 1, seqs_per_context: int = LLAMACPP_SEQS_PER_CONTEXT, dtype: str | None = None,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, gpu_layers: int = 0) -> MemoryPlan:
    """Weights + KV cache + adapters for ``engine`` (see ``MemoryPlan.formula`` for each number).

    ``adapter_bytes``: each adapter as the engine holds it (``adapter_nbytes``); ``adapter_slots``:
    vLLM's --max-loras (default: min(adapters, concurrency), at least 1); ``kv_bytes_per_elem``: default
    the model dtype for vLLM and MLX, 2 (F16) for llama.cpp; ``contexts``: the most llama.cpp contexts; ``dtype``:
    vLLM's --dtype (vLLM's names), or tuneport's --dtype for llama.cpp and MLX (what an HF base is
    converted to); ``gpu_layers``: llama.cpp's n_gpu_layers (-1: all), its VRAM in ``per_gpu``."""
    spec = engine_spec(engine)
    slots = adapter_slots or max(1, min(load.n_adapters, load.concurrency))
    opts = dict(adapter_bytes=list(adapter_bytes), max_lora_rank=max_lora_rank, adapter_slots=slots,
                kv_bytes_per_elem=kv_bytes_per_elem, contexts=contexts, seqs_per_context=seqs_per_context,
                dtype=dtype, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                gpu_layers=gpu_layers)
    return spec.load_planner()(artifact, load, opts)


def plan_exllamav3(a: ArtifactInfo, load: ServeLoad, o: dict) -> MemoryPlan:
    """exllamav3 (in process, or TabbyAPI's backend): the EXL3 tensors as stored, an FP16 cache of ``cache_size``
    tokens (n_ctx × concurrency rounded up to 256), the start-up adapters' fp16 LoRA matrices."""
    from tuneport.convert.exl3.tabby import CACHE_QUANTUM, round_cache

    if a.format != "exl3":
        raise UserError(f"ExLlamaV3 loads EXL3 only, not {FORMAT_LABELS.get(a.format, a.format)}",
                        "convert it on a CUDA host: tuneport export --target exl3")
    weights = a.weight_bytes
    tokens = round_cache(load.context_len * load.concurrency)
    kv, kv_how = _kv(a, tokens, o["kv_bytes_per_elem"] or 2,
                     f"cache_size: n_ctx {load.context_len} × {load.concurrency} requests rounded up to "
                     f"{CACHE_QUANTUM}")
    formula = {"weights": f"{_n(weights)} bytes of EXL3 tensors as stored (trellis, suh/svh, fp16 embeddings and "
                          "norms)", "kv_cache": kv_how + " (cache_mode FP16)",
               "adapters": "fp16 A and B of each start-up adapter (exllamav3's run-time LoRA)",
               "total": "weights + kv_cache + adapters on the GPU (plus ExLlamaV3's working buffers)"}
    adapters = sum(o["adapter_bytes"])
    return MemoryPlan("exllamav3", weights, kv, adapters, weights + kv + adapters, 0, None, formula)


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


