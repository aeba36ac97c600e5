"""Mamba-2 layers (Granite 4's hybrid) in GGUF, as llama.cpp's converter writes them (its ``conversion/mamba.py``) and
its ``build_mamba2_layer`` reads them:

- ``A_log`` becomes ``ssm_a = -exp(A_log)`` and ``D`` ``ssm_d``, both ``[heads, 1]``; ``dt_bias`` the bias
  ``ssm_dt.bias``; the depthwise ``conv1d`` ``[C, 1, K]`` is squeezed to ``[C, K]`` (``GGUFArch.squeezed``); the
  gated norm's weight is laid out ``[groups, inner / groups]``;
- the hyperparameters: ``ssm.*`` from the ``mamba_*`` config keys; a layer is recurrent where its KV-head count is 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]


def is_mamba(name: str) -> bool:
    return ".mamba." in name


def source_name(name: str) -> str:
    """The name gguf's tensor map knows (llama.cpp's converter renames ``dt_bias`` before mapping)."""
    return name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".mamba.dt_bias") else name


def gguf_shape(name: str, shape: tuple[int, ...], cfg: dict) -> tuple[int, ...]:
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if not is_mamba(name):
        return shape
    if leaf in ("A_log", "D"):
        return (shape[0], 1)
    if leaf == "norm":
        groups = int(cfg.get("mamba_n_groups") or 1)
        return (groups, shape[0] // groups)
    return shape


def tensor_transform(name: str, cfg: dict) -> Transform | None:
    """How the base tensor ``name`` of a Mamba-2 layer is written (None: as it is; the conv's squeeze aside)."""
    if not is_mamba(name):
        return None
    shape_of = lambda t: gguf_shape(name, tuple(t.shape), cfg)  # noqa: E731
    if name.endswith(".A_log"):
        return lambda t: -torch.exp(t.float()).reshape(shape_of(t))
    if name.endswith((".D", ".norm.weight")):
        return lambda t: t.float().reshape(shape_of(t))
    return None


def inner_size(cfg: dict) -> int:
    return int(cfg.get("mamba_expand") or 2) * int(cfg["hidden_size"])


def hparams(cfg: dict) -> dict[str, int]:
    """llama.cpp's ``ssm.*`` keys (its head count is ``time_step_rank``)."""
    return {"ssm.conv_kernel": int(cfg.get("mamba_d_conv") or 4), "ssm.state_size": int(cfg["mamba_d_state"]),
            "ssm.group_count": int(cfg.get("mamba_n_groups") or 1), "ssm.inner_size": inner_size(cfg),
            "ssm.time_step_rank": int(cfg["mamba_n_heads"])}
