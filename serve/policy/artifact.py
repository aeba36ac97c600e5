"""What a model artifact is (format) and the dimensions a memory plan needs."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tuneport.convert.arch import ARCHS, ArchSpec, known_arch
from tuneport.convert.checkpoint import Checkpoint
from tuneport.convert.errors import UserError
from tuneport.convert.gguf.read import gguf_field, open_gguf
from tuneport.convert.mlx import ADAPTER_WEIGHTS
from tuneport.convert.mlx.read import mlx_model_info
from tuneport.convert.safetensors_file import SafetensorsFile
from tuneport.convert.tensors import TensorMeta

# -- artifacts ------------------------------------------------------------------------------------
FORMATS = ("gguf", "hf", "awq", "compressed-tensors", "gptq", "exl3", "mlx")
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


def _packed(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    """(in, out) of a 4-bit module in a format tuneport writes (convert.awq.formats reads it)."""
    from tuneport.convert.stored.int4 import packed_weight_shape

    shape = packed_weight_shape(ckpt, m)
    return (shape[1], shape[0]) if shape else None


def _awq(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    return _packed(ckpt, m) or _plain(ckpt, m)


def _gptq(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    q, g = _meta(ckpt, f"{m}.qweight"), _meta(ckpt, f"{m}.g_idx")  # [in/pack, out], [in]
    if q is None:
        return _plain(ckpt, m)
    return (g.shape[0] if g else q.shape[0] * 32 // _bits(ckpt.quantization), q.shape[1])


def _compressed(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    if shape := _packed(ckpt, m):  # pack-quantized: the original [out, in] is stored as a tensor
        return shape
    p = _meta(ckpt, f"{m}.weight_packed")  # [out, in * bits / 32]
    return (p.shape[1] * 32 // _bits(ckpt.quantization), p.shape[0]) if p else _plain(ckpt, m)


def _exl3(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    t = _meta(ckpt, f"{m}{EXL3_TENSOR_SUFFIX}")
    return (t.shape[0] * 16, t.shape[1] * 16) if t else _plain(ckpt, m)


def _mlx(ckpt: Checkpoint, m: str) -> tuple[int, int] | None:
    """mlx-lm's packed uint32 weights, read unpacked by the checkpoint (convert.mlx.read)."""
    shape = ckpt.weight_shape(f"{m}.weight")
    return (shape[1], shape[0]) if shape is not None and len(shape) == 2 else None  # [out, in]


SHAPE_READERS: dict[str, ShapeReader] = {
    "hf": _plain, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed, "exl3": _exl3, "mlx": _mlx,
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


def _describe_hf(path: Path, fmt: str | None = None) -> ArtifactInfo:
    ckpt = Checkpoint(path)
    fmt = fmt or _hf_format(ckpt)
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
    from tuneport.convert.gguf.tensor_names import tensor_name_map

    arch = next((a for a in ARCHS.values() if a.gguf_arch == garch), None)
    if arch is None:
        return {}, {}
    try:
        tmap = tensor_name_map(garch, max(n_layers, 1))
    except UserError:  # an architecture the installed gguf package does not name
        return {}, {}
    shapes = {t.name.removesuffix(".weight"): t.shape for t in reader.tensors}
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
    r = open_gguf(path)
    garch = str(gguf_field(r, "general.architecture") or "")

    def num(key: str) -> int:
        v = gguf_field(r, f"{garch}.{key}")
        return int(max(v) if isinstance(v, list) else v or 0)

    n_heads, hidden = num("attention.head_count"), num("embedding_length")
    n_layers = num("block_count")
    vocab = num("vocab_size") or len(gguf_field(r, "tokenizer.ggml.tokens") or [])
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


def _not_a_model(p: Path) -> UserError:
    what = "does not exist" if not p.exists() else "is neither a .gguf file nor a model directory"
    return UserError(f"{p} {what}", "pass a GGUF file or a local Hugging Face model directory (config.json + "
                                    "*.safetensors)")


def artifact_format(path: str | Path) -> str:
    """The format of a model (one of FORMATS) from its name and config only: no tensor is read."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return "gguf"
    if mlx_model_info(p) is not None:
        return "mlx"
    if p.is_dir():
        return _hf_format(Checkpoint(p))
    raise _not_a_model(p)


def describe_artifact(path: str | Path) -> ArtifactInfo:
    """Format and dimensions of a ``.gguf`` file or a local safetensors model directory."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _describe_gguf(p)
    if p.is_dir():
        return _describe_hf(p, "mlx" if mlx_model_info(p) is not None else None)
    raise _not_a_model(p)


def adapter_nbytes(path: str | Path, engine: str, dtype_bytes: int = 2) -> int:
    """What one adapter occupies once ``engine`` has it. A GGUF LoRA: its file. A PEFT dir: its elements ×
    4 for llama.cpp (tuneport converts PEFT to an F32 GGUF LoRA: 2× a bf16 file, 1× an fp32 one) and MLX
    (fp32 LoRA matrices, as mlx-lm keeps them), × ``dtype_bytes`` for vLLM (it casts adapters to the model
    dtype). An mlx-lm adapter dir: its elements × 4."""
    p = Path(path)
    if p.is_dir() and (p / ADAPTER_WEIGHTS).exists():
        return 4 * sum(t.numel for t in SafetensorsFile(p / ADAPTER_WEIGHTS).tensors.values())
    if p.is_dir() and not (p / "adapter_config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        p = ggufs[0] if len(ggufs) == 1 else p
    if p.is_file():
        return p.stat().st_size
    st = p / "adapter_model.safetensors"
    if not st.exists():
        raise UserError(f"{p} holds no adapter_model.safetensors or single .gguf", "pass a PEFT dir or a GGUF LoRA")
    numel = sum(t.numel for t in SafetensorsFile(st).tensors.values())
    return numel * (4 if engine in ("llamacpp", "mlx") else dtype_bytes)


