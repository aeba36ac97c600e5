"""Gated DeltaNet layers (Qwen3.5 / 3.6's linear attention) in GGUF, as llama.cpp's converter writes them
(its ``conversion/qwen.py``) and its ``qwen35`` graph reads them:

- ``A_log`` becomes ``ssm_a = -exp(A_log)``, ``dt_bias`` the bias ``ssm_dt.bias``, the depthwise ``conv1d``
  ``[C, 1, K]`` is squeezed to ``[C, K]``;
- transformers groups the value heads by key head (``repeat_interleave``: v0..v(r-1) of key head 0, then key head
  1's), llama.cpp tiles them (v0 of every key head, then v1 of every key head): where the two head counts differ,
  every value-head axis is reordered (the V rows of ``in_proj_qkv`` and of the conv, ``in_proj_z``'s rows,
  ``in_proj_a`` / ``in_proj_b``'s rows, ``A_log`` and ``dt_bias``, ``out_proj``'s columns), and a LoRA's B rows
  or A columns the same way;
- the hyperparameters: ``ssm.*`` from the ``linear_*`` config keys, one recurrent flag per layer, the M-RoPE
  sections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]
MROPE_SECTIONS = [11, 11, 10]  # transformers' default when rope_parameters has none


@dataclass(frozen=True)
class DeltaNetShape:
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int
    conv_kernel: int

    @classmethod
    def of(cls, cfg: dict) -> DeltaNetShape:
        return cls(int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]),
                   int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]),
                   int(cfg.get("linear_conv_kernel_dim") or 4))

    @property
    def grouped(self) -> bool:
        """transformers' value-head order differs from llama.cpp's."""
        return self.key_heads != self.value_heads

    def tile(self, t: torch.Tensor, dim: int, head_dim: int, start: int = 0) -> torch.Tensor:
        """Value heads along ``dim`` (from ``start``) from grouped-by-key-head to tiled order."""
        if not self.grouped:
            return t
        t = t.movedim(dim, 0)
        head, rest = t[:start], t[start:]
        r = self.value_heads // self.key_heads
        rest = rest.reshape(self.key_heads, r, head_dim, *rest.shape[1:]).transpose(0, 1).reshape(rest.shape)
        return torch.cat([head, rest]).movedim(0, dim)


# Where each Gated DeltaNet tensor keeps its value heads: (axis, per-head width, offset); "v" stands for the value
# head size, "qk" for the query and key rows before the values (2 x key heads x key head size)
VALUE_HEAD_AXES: dict[str, tuple[int, str | int, str | int]] = {
    "in_proj_qkv": (0, "v", "qk"), "conv1d": (0, "v", "qk"), "in_proj_z": (0, "v", 0),
    "in_proj_a": (0, 1, 0), "in_proj_b": (0, 1, 0), "A_log": (0, 1, 0), "dt_bias": (0, 1, 0), "out_proj": (1, "v", 0),
}


def is_delta_net(name: str) -> bool:
    return ".linear_attn." in name


def source_name(name: str) -> str:
    """The name gguf's tensor map knows (llama.cpp's converter renames ``dt_bias`` before mapping)."""
    return name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".linear_attn.dt_bias") else name


def gguf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``name`` has in GGUF (the conv squeezed)."""
    if name.endswith(".linear_attn.conv1d.weight") and len(shape) == 3:
        return (shape[0], shape[2])
    return shape


def _reorder(module: str, cfg: dict) -> tuple[int, Transform] | None:
    """(axis, reorder) of ``module``'s value heads from transformers' order to llama.cpp's; None where none moves."""
    axes = VALUE_HEAD_AXES.get(module.rsplit(".", 1)[-1]) if is_delta_net(module) else None
    s = DeltaNetShape.of(cfg) if axes else None
    if s is None or not s.grouped:
        return None
    dim, width, start = ({"v": s.value_dim, "qk": 2 * s.key_heads * s.key_dim}.get(x, x) for x in axes)
    return dim, lambda t: s.tile(t, dim, width, start)


def tensor_transform(name: str, cfg: dict) -> Transform | None:
    """How the base tensor ``name`` of a Gated DeltaNet layer is written to GGUF (None: as it is)."""
    if not is_delta_net(name):
        return None
    module = name.removesuffix(".weight")
    reorder = _reorder(module, cfg)
    tile = reorder[1] if reorder else (lambda t: t)
    leaf = module.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return lambda t: -torch.exp(tile(t.float()))
    if leaf in ("dt_bias", "conv1d"):
        return lambda t: tile(t.float().squeeze(1) if t.dim() == 3 else t.float())
    return reorder[1] if reorder else None


def lora_transforms(module: str, cfg: dict) -> tuple[Transform | None, Transform | None]:
    """(on A, on B) for a LoRA on ``module``: the base's value-head reorder applied to B's rows or A's columns."""
    reorder = _reorder(module, cfg)
    if reorder is None:
        return None, None
    dim, tile = reorder
    return (tile, None) if dim == 1 else (None, tile)


def write_hparams(writer, arch: str, cfg: dict) -> None:
    """llama.cpp's ``ssm.*`` keys, the recurrent layers and the M-RoPE sections (text: every section the same
    position, so plain partial NeoX RoPE, as transformers computes it for text)."""
    s = DeltaNetShape.of(cfg)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", s.conv_kernel)
    writer.add_uint32(f"{arch}.ssm.state_size", s.key_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", s.key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", s.value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", s.value_dim * s.value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_kinds(cfg)])
    writer.add_uint32(f"{arch}.full_attention_interval", int(cfg.get("full_attention_interval") or 4))
    writer.add_array(f"{arch}.rope.dimension_sections", rope_sections(cfg))


def rope_sections(cfg: dict) -> list[int]:
    """The M-RoPE sections llama.cpp rotates text with as transformers does. Its interleaved M-RoPE gives rotated pair
    s the time position while s < 3 * sections[s % 3] (and the s % 3 == 1, 2 rows the height and width ones, equal for
    text), and the fourth position (0 for text: no rotation) past that; transformers rotates every pair by the time
    position. The model's sections are written where they cover every pair (the released ones' [11, 11, 10] over 32
    pairs do) within the rotated size (llama.cpp asserts their sum is at most that), else sections that do, which
    rotate text the same (an image's rows are not in a text model's GGUF)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    sections = list(params.get("mrope_section") or MROPE_SECTIONS)[:3]
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    pairs = int(head_dim * partial) // 2
    period = sum(sections) or 1
    if len(sections) < 3 or sum(sections) > 2 * pairs or any(
            not (s % period) < 3 * sections[(s % period) % 3] for s in range(pairs)):
        sections = [-(-pairs // 3)] * 3  # every pair below 3 * ceil(pairs / 3), and at most 2 * pairs in all
    return [*sections, 0]


def layer_kinds(cfg: dict) -> list[str]:
    """``layer_types``, or transformers' default from ``full_attention_interval`` (every 4th layer full)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = int(cfg.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])]
