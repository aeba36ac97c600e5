"""Streaming merge: ``W' = W + Σ weight·scale·(B @ A)`` in fp32, cast once to the output dtype.

DoRA: ``W' = m · (W + ΔW) / ‖W + ΔW‖`` with PEFT's per-output-row norm. ``modules_to_save`` tensors
replace the base's (resized vocabularies included). One base tensor is in memory at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adapter import Adapter
from .adapter_config import quantized_base_note
from .checkpoint import Checkpoint
from .errors import UserError
from .options import check_choice
from .tensors import TensorMeta

# --dtype (options.DTYPES) -> the output dtype; auto keeps each tensor's own
OUT_DTYPES = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CONFIG_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class WeightedAdapter:
    adapter: Adapter
    weight: float = 1.0


@dataclass
class MergePlan:
    """Everything decided before the first tensor is read: output tensors, config changes, sources."""

    base: Checkpoint
    adapters: list[WeightedAdapter]
    out_dtype: torch.dtype | None
    specs: list[TensorMeta] = field(default_factory=list)
    source: dict[str, str] = field(default_factory=dict)  # output name -> base tensor it starts from
    config_updates: dict[str, object] = field(default_factory=dict)
    untied: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict:
        return {**self.base.config, **self.config_updates}

    @property
    def matrix_dtype(self) -> torch.dtype:
        """The widest floating dtype of the output's matrices (what the model is stored in)."""
        return max((s.dtype for s in self.specs if s.dtype.is_floating_point and len(s.shape) == 2),
                   key=lambda d: d.itemsize, default=torch.float32)


def _mismatch(adapter: Adapter, tensor: str, base_shape, adapter_shape) -> UserError:
    base_hint = adapter.config.get("base_model_name_or_path")
    return UserError(
        f"adapter {adapter.name} does not fit this base: {tensor} is {list(base_shape)} in the base "
        f"but {list(adapter_shape)} in the adapter",
        "the adapter was trained on another model: pass the base it was trained on"
        + (f" (its adapter_config.json names {base_hint})" if base_hint else ""),
    )


def plan_merge(base: Checkpoint, adapters: list[WeightedAdapter], dtype: str = "auto") -> MergePlan:
    """Check every adapter against the base and decide the output; raises UserError on a misfit."""
    from .experts import fit_to_base
    from .multimodal import adapter_on_checkpoint

    check_choice("--dtype", dtype, tuple(OUT_DTYPES))
    for w in adapters:
        fit_to_base(w.adapter, base)  # mixture-of-experts LoRA in the checkpoint's per-expert layout
    # a whole multimodal checkpoint: PEFT's (transformers 5) module names as the checkpoint stores them
    adapters = [WeightedAdapter(adapter_on_checkpoint(w.adapter, base), w.weight) for w in adapters]
    plan = MergePlan(base, adapters, OUT_DTYPES[dtype])
    plan.notes.extend(getattr(base, "notes", []))  # e.g. a multimodal checkpoint's text model, exported alone
    plan.notes.extend(n for w in adapters if (n := quantized_base_note(w.adapter.name, w.adapter.config)))
    arch = base.arch
    embed = f"{arch.embed}.weight" if arch else "model.embed_tokens.weight"
    head = f"{arch.lm_head}.weight" if arch else "lm_head.weight"
    tied = base.tied_embeddings

    dora = [w for w in adapters if w.adapter.use_dora]
    if dora and (len(adapters) > 1 or dora[0].weight != 1.0):
        raise UserError(f"DoRA adapter {dora[0].adapter.name} can only be merged alone and with weight 1",
                        "merge it on its own, then merge the others into that output")

    def base_shape(name: str) -> tuple[int, ...] | None:
        if (shape := base.weight_shape(name)) is not None:
            return shape
        if name == head and tied and embed in base:
            return base.meta(embed).shape
        return None

    shapes: dict[str, tuple[int, ...]] = {}
    touched: set[str] = set()
    replaced_by: dict[str, list[str]] = {}
    for w in adapters:
        a = w.adapter
        for target, mod in a.modules.items():
            bs = base_shape(target)
            if bs is None:
                raise UserError(
                    f"adapter {a.name} targets {mod.module}, which the base lacks",
                    "the adapter was trained on another model: pass the base it was trained on",
                )
            if tuple(mod.base_shape()) != tuple(bs) and tuple(mod.base_shape()) != shapes.get(target):
                raise _mismatch(a, target, bs, mod.base_shape())
            if mod.bias is not None:
                bias = f"{mod.module}.bias"
                if bias not in base and bias not in a.replacements:
                    raise UserError(f"adapter {a.name} has a LoRA bias (lora_bias) on {mod.module}, "
                                    "which has no bias in the base", "merging it would change the architecture")
            touched.add(target)
        for name, t in a.replacements.items():
            bs = base_shape(name)
            if bs is None:
                raise UserError(f"adapter {a.name} replaces {name}, which the base lacks",
                                "the adapter was trained on another model: pass the base it was trained on")
            shape = tuple(t.shape)
            resized = name in (embed, head) and len(shape) == 2 and shape[1:] == bs[1:] and shape != bs
            if shape != bs and not resized:
                raise _mismatch(a, name, bs, shape)
            if resized:
                shapes[name] = shape
            replaced_by.setdefault(name, []).append(a.name)
            touched.add(name)

    for name, who in replaced_by.items():
        if name in shapes and (len(who) > 1 or any(w.weight != 1.0 for w in adapters if w.adapter.name in who)):
            raise UserError(f"{name} is resized by {', '.join(who)}",
                            "a resized vocabulary can come from one adapter only, merged with weight 1")
    # Each adapter's modules must fit the resized shape too (e.g. embedding LoRA after resize).
    for w in adapters:
        for target, mod in w.adapter.modules.items():
            want = shapes.get(target, base_shape(target))
            if tuple(mod.base_shape()) != tuple(want):
                raise _mismatch(w.adapter, target, want, mod.base_shape())

    vocab = {shapes[n][0] for n in (embed, head) if n in shapes}
    if vocab:
        if len(vocab) > 1 or (not tied and (embed in shapes) != (head in shapes)):
            raise UserError("the adapter resizes the input and output embeddings differently",
                            "save both embed_tokens and lm_head in modules_to_save")
        n_vocab = vocab.pop()
        if isinstance(text := base.config.get("text_config"), dict):  # multimodal: the text model's vocabulary
            plan.config_updates["text_config"] = {**text, "vocab_size": n_vocab}
        if "vocab_size" in base.config or not isinstance(text, dict):
            plan.config_updates["vocab_size"] = n_vocab

    keep_tied = all(bool(w.adapter.config.get("ensure_weight_tying")) for w in adapters) and adapters
    if tied and (embed in touched or head in touched) and not keep_tied:
        # PEFT applies an embedding change only where it was trained (input or output side); writing
        # an explicit lm_head keeps that behaviour after the merge.
        plan.untied = True
        plan.config_updates["tie_word_embeddings"] = False
        plan.notes.append("untied embeddings: the adapter changes embed_tokens or lm_head of a tied base")

    for name in base.names():
        meta = base.meta(name)
        plan.specs.append(TensorMeta(name, _out_dtype(meta.dtype, plan.out_dtype), shapes.get(name, meta.shape)))
        plan.source[name] = name
    if plan.untied:
        meta = base.meta(embed)
        plan.specs.append(TensorMeta(head, _out_dtype(meta.dtype, plan.out_dtype), shapes.get(head, meta.shape)))
        plan.source[head] = embed
    if plan.out_dtype is not None:
        name = CONFIG_DTYPE_NAMES[plan.out_dtype]
        plan.config_updates["torch_dtype"] = name
        if "dtype" in base.config:
            plan.config_updates["dtype"] = name
    return plan


def _out_dtype(src: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if (wanted is not None and src.is_floating_point) else src


CHUNK_BYTES = 4 << 20  # rows are merged in fp32 blocks of about this size, which stay in cache


def merge_one(plan: MergePlan, spec: TensorMeta) -> torch.Tensor:
    """The output tensor ``spec.name``: base (or replacement) + weighted LoRA deltas, DoRA, LoRA biases.

    Work is done in fp32 over blocks of rows and cast once into a fresh output tensor; the tensor read
    from disk is never modified (it may still be being hashed).
    """
    name = spec.name
    t = plan.base.read(plan.source[name])
    replacing = [(w, w.adapter.replacements[name]) for w in plan.adapters if name in w.adapter.replacements]
    if len(replacing) == 1 and replacing[0][0].weight == 1.0:
        t = replacing[0][1]
    elif replacing:  # linear merge of task vectors: W + Σ w_i (T_i - W)
        w32 = t.float()
        t = w32 + sum(w.weight * (r.float() - w32) for w, r in replacing)
    mods = [(w.weight, w.adapter.modules[name]) for w in plan.adapters if name in w.adapter.modules]
    bias_mods = [(w.weight, m) for w in plan.adapters for m in w.adapter.modules.values()
                 if m.bias is not None and f"{m.module}.bias" == name]
    if bias_mods:
        b32 = t.float().clone()
        for weight, mod in bias_mods:
            b32.add_(mod.bias.float(), alpha=mod.scale * weight)
        t = b32
    if mods:
        return _apply_lora(t, mods, spec.dtype)
    return t.to(spec.dtype) if t.dtype != spec.dtype else t


def _apply_lora(t: torch.Tensor, mods: list, dtype: torch.dtype) -> torch.Tensor:
    """``t + Σ weight·scale·L@R`` (then DoRA) in fp32 row blocks, written into a new ``dtype`` tensor."""
    # delta = L @ R with rows matching t's rows: B @ A, or Aᵀ @ Bᵀ for embeddings / fan_in_fan_out.
    factors = []
    for weight, mod in mods:
        transposed = mod.kind == "embedding" or mod.fan_in_fan_out
        left, right = (mod.A.float().T, mod.B.float().T) if transposed else (mod.B.float(), mod.A.float())
        factors.append((left, right, mod.scale * weight, mod.magnitude, transposed))
    dora_transposed = any(f[3] is not None and f[4] for f in factors)
    if dora_transposed:  # DoRA norms run over the other axis: merge the whole tensor at once
        w32 = t.float().clone()
        for left, right, alpha, _, _ in factors:
            w32.addmm_(left, right, alpha=alpha)
        for _, _, _, magnitude, _ in factors:
            if magnitude is not None:
                w32.T.mul_((magnitude.float() / torch.linalg.norm(w32.T, dim=1)).view(-1, 1))
        return w32.to(dtype)
    out = torch.empty(t.shape, dtype=dtype)
    rows = max(1, CHUNK_BYTES // (4 * max(1, t.shape[1])))
    for i in range(0, t.shape[0], rows):
        j = min(i + rows, t.shape[0])
        w32 = t[i:j].to(torch.float32, copy=True)
        for left, right, alpha, _, _ in factors:
            w32.addmm_(left[i:j], right, alpha=alpha)
        for _, _, _, magnitude, _ in factors:
            if magnitude is not None:  # DoRA, PEFT's norm over the input dim of [out, in]
                w32.mul_((magnitude[i:j].float() / torch.linalg.norm(w32, dim=1)).view(-1, 1))
        out[i:j].copy_(w32)
    return out
