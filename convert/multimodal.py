"""Multimodal checkpoints whose text model text-only targets export: the text tower as a checkpoint of its
own (tensor names, config) and adapters renamed to match; the vision tower is dropped with a note, and an
adapter that changes it is refused with the reason.

Gemma 3 (4B/12B/27B, ``Gemma3ForConditionalGeneration``) stores its text model under ``language_model.model``
(the hub's layout, which transformers 5 still writes) or ``model.language_model`` (transformers 5 in memory,
hence PEFT's module names); its ``text_config`` leaves most values to ``Gemma3TextConfig``'s defaults, so the
view's config is that class's full dict.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from .adapter import Adapter
from .arch import ARCHS, TextTower
from .checkpoint import Checkpoint
from .errors import UserError

TEXT_TOWERS: dict[str, TextTower] = {m: a.text_tower for m, a in ARCHS.items() if a.text_tower}  # a table view
TEXT_ONLY_TARGETS = ("gguf", "mlx")  # what exports the text tower alone
# What keeps the whole checkpoint (vision tower included). vLLM serves Gemma3ForConditionalGeneration with LoRA on
# its language model; images need torchvision, which its CPU build gets only as tests/env/torchvision_cpu_ops.py says.
# AWQ quantizes the language model and keeps the vision tower 16-bit.
FULL_TARGETS = ("merge", "safetensors", "vllm", "awq")
MULTIMODAL_REFUSAL = "multimodal checkpoints not exported yet (the vision tower would have to be kept)"


def checkpoint_name(tower: TextTower, name: str, present) -> str:
    """``name`` (a transformers 5 / PEFT name) as the checkpoint stores it: renamed when the checkpoint has
    the hub's layout (its first rename's target prefix; a tied lm_head is named that way too), its tower with or
    without the level transformers 5 drops."""
    if name in present or not tower.checkpoint_renames:
        return name
    marker = tower.checkpoint_renames[0][1]
    if not any(n.startswith(marker) for n in present):
        return name
    for old, new in tower.checkpoint_renames:
        if name.startswith(old):
            renamed = new + name[len(old):]
            hub = _hub_tower_name(tower, renamed)
            return hub if renamed not in present and hub in present else renamed
    return name


def vllm_name(model_type: str, name: str) -> str:
    """``name`` as vLLM loads it: a multimodal checkpoint's tower in the hub's layout."""
    tower = TEXT_TOWERS.get(model_type)
    return _hub_tower_name(tower, name) if tower else name


def _hub_tower_name(tower: TextTower, name: str) -> str:
    for old, new in tower.vllm_renames:
        if name.startswith(old) and not name.startswith(new):
            return new + name[len(old):]
    return name


def disk_names(model_type: str, memory: dict[str, tuple[int, ...]], present) -> dict[str, tuple[int, ...]]:
    """A multimodal model's state-dict shapes under the names the checkpoint ``present`` stores."""
    tower = TEXT_TOWERS.get(model_type)
    if tower is None:
        return memory
    return {checkpoint_name(tower, n, present): s for n, s in memory.items()}


def adapter_on_checkpoint(adapter: Adapter, ckpt: Checkpoint) -> Adapter:
    """A copy of ``adapter`` with its modules named as the whole multimodal checkpoint stores them."""
    tower = TEXT_TOWERS.get(ckpt.model_type)
    if tower is None:
        return adapter
    present = set(ckpt.names())
    out = copy.copy(adapter)
    out.modules = {}
    for mod in adapter.modules.values():
        target = checkpoint_name(tower, mod.target, present)
        out.modules[target] = replace(mod, module=target.removesuffix(".weight"))
    out.replacements = {checkpoint_name(tower, n, present): t for n, t in adapter.replacements.items()}
    out.replacement_origin = {checkpoint_name(tower, n, present): o for n, o in adapter.replacement_origin.items()}
    return out


def _rename(tower: TextTower, name: str) -> str | None:
    """The text model's name for ``name``; None for the vision parts (and names of neither)."""
    for old, new in tower.renames:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def text_config(tower: TextTower, config: dict) -> dict:
    import transformers

    cls = getattr(transformers, tower.config_class)
    text = dict(config.get("text_config") or {})
    text.pop("model_type", None)
    for key in tower.inherited:
        if key in config:
            text[key] = config[key]
    full = cls(**text).to_dict()
    return {**full, **{k: v for k, v in text.items() if k not in full}}  # and what the class keeps aside


def text_tower_view(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` seen as its text model: names renamed, vision tensors left out, the text config."""
    tower = TEXT_TOWERS[ckpt.model_type]
    view = copy.copy(ckpt)
    view.config = text_config(tower, ckpt.config)
    view.model_type = tower.text_model_type
    view._where, view._metas, view._source = {}, {}, {}
    dropped = 0
    for name in ckpt.names():
        new = _rename(tower, name)
        if new is None:
            if not name.startswith(tower.vision):
                raise UserError(f"{ckpt.path}: tensor {name} is neither in the text model nor in the vision tower",
                                "pass an unmodified checkpoint")
            dropped += 1
            continue
        view._where[new] = ckpt._where[name]
        view._metas[new] = replace(ckpt.meta(name), name=new)
        view._source[new] = name
    view.notes = [*getattr(ckpt, "notes", []), f"{ckpt.model_type}: the text model exported ({dropped} vision-tower "
                                                "tensors left out: this target runs text only)"]
    original_read = ckpt.read
    view.read = lambda name: original_read(view._source[name])  # type: ignore[method-assign]
    return view


def whole_checkpoint_namer(ckpt: Checkpoint):
    """A function naming a text-model tensor or module (``model.layers.0...``, as the text view and its quantized
    outputs name them) as the whole checkpoint ``ckpt`` stores it, in the layout vLLM loads."""
    tower = TEXT_TOWERS[ckpt.model_type]
    present = set(ckpt.names())

    def name(text_name: str) -> str:
        for prefix, memory in tower.memory_prefixes:
            if text_name.startswith(prefix):
                return vllm_name(ckpt.model_type, checkpoint_name(tower, memory + text_name[len(prefix):], present))
        raise ValueError(f"{text_name} is not a text-model name")
    return name


def checkpoint_aliases(name: str) -> list[str]:
    """Other names a multimodal checkpoint may store module or tensor ``name`` (transformers 5's) under."""
    out = []
    for tower in TEXT_TOWERS.values():
        for old, new in tower.checkpoint_renames:
            if name.startswith(old):
                out.append(_hub_tower_name(tower, new + name[len(old):]))
                break
    return out


def is_vision(model_type: str, name: str) -> bool:
    """Whether the whole checkpoint's tensor ``name`` is outside the text model."""
    return _rename(TEXT_TOWERS[model_type], name) is None


def split_towers(adapter: Adapter, model_type: str) -> tuple[Adapter | None, Adapter | None]:
    """``adapter`` as its text-model part (renamed for the text view) and the rest (names kept); None where a
    part is empty."""
    tower = TEXT_TOWERS[model_type]
    text, rest = copy.copy(adapter), copy.copy(adapter)
    text.modules, rest.modules = {}, {}
    for key, mod in adapter.modules.items():
        if (new := _rename(tower, mod.target)) is None:
            rest.modules[key] = mod
        else:
            module = new.removesuffix(".weight")
            text.modules[f"{module}.weight"] = replace(mod, module=module)
    text.replacements = {_rename(tower, n): t for n, t in adapter.replacements.items() if _rename(tower, n)}
    text.replacement_origin = {_rename(tower, n): o for n, o in adapter.replacement_origin.items()
                               if _rename(tower, n)}
    rest.replacements = {n: t for n, t in adapter.replacements.items() if _rename(tower, n) is None}
    rest.replacement_origin = {n: o for n, o in adapter.replacement_origin.items() if _rename(tower, n) is None}
    return (text if text.modules or text.replacements else None,
            rest if rest.modules or rest.replacements else None)


def vision_parts(adapter: Adapter, model_type: str) -> list[str]:
    """The modules and saved tensors of ``adapter`` outside a multimodal model's text model."""
    _, rest = split_towers(adapter, model_type)
    return sorted(m.module for m in rest.modules.values()) + sorted(rest.replacements) if rest else []


def text_tower_adapter(adapter: Adapter, model_type: str, target: str) -> Adapter:
    """``adapter`` renamed for the text view; a module in the vision tower is refused with the reason."""
    vision = vision_parts(adapter, model_type)
    if vision:
        raise UserError(f"adapter {adapter.name} changes the vision tower ({vision[0]}"
                        f"{f' and {len(vision) - 1} more' if len(vision) > 1 else ''}), which --target {target} "
                        "drops: its outputs would differ on images",
                        "merge it (tuneport merge keeps the vision tower), or train the adapter on the language model "
                        "only")
    text, _ = split_towers(adapter, model_type)
    return text if text is not None else adapter  # an adapter with no tensors at all
