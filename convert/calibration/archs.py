"""Which calibration layout an architecture has (``AWQ_ARCHS``: a view of ``convert.arch``; a multimodal
checkpoint calibrates its text model) and why AWQ or the importance matrix refuses one."""

from __future__ import annotations

from ..arch import ARCHS, known_arch, target_refusal
from ..errors import UserError
from .layouts import AWQArch

AWQ_ARCHS: dict[str, AWQArch] = {m: a.awq for m, a in ARCHS.items() if a.awq is not None}


def calibrated_model_type(model_type: str) -> str:
    """The architecture AWQ calibrates for ``model_type``: a multimodal checkpoint's text model."""
    arch = known_arch(model_type)
    tower = arch.text_tower if arch is not None else None
    return tower.text_model_type if tower else model_type


def awq_refusal(model_type: str) -> str | None:
    """Why AWQ refuses ``model_type``, or None."""
    return target_refusal(calibrated_model_type(model_type), "awq")


def dense_layers_refusal(arch: AWQArch, config: dict) -> str | None:
    """Why a mixture-of-experts model with dense MLP layers among its sparse ones cannot be calibrated, or None."""
    off = [f"{key} {config[key]!r}" for key, sparse in arch.sparse_layers
           if config.get(key, sparse) not in (sparse, None)]
    if off:
        return (f"this {config.get('model_type')} has dense MLP layers among its sparse ones ({', '.join(off)}), "
                "which the calibration pass does not run")
    return None


def awq_arch_for(model_type: str) -> AWQArch:
    if (why := awq_refusal(model_type)) is None:
        return AWQ_ARCHS[calibrated_model_type(model_type)]
    raise UserError(f"AWQ does not support architecture {model_type!r} ({why})",
                    f"supported: {', '.join(sorted(AWQ_ARCHS))}; use --target vllm or gguf for this base")
