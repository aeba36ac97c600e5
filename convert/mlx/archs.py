"""Which mlx-lm model runs an architecture (``MLX_ARCHS``: a view of ``convert.arch``), why --target mlx refuses
one, and a config as mlx-lm must read it."""

from __future__ import annotations

from ..arch import ARCHS, target_refusal
from ..errors import UserError
from .arch_facts import MlxArch

MLX_ARCHS: dict[str, MlxArch] = {m: a.mlx for m, a in ARCHS.items() if a.mlx is not None}


def mlx_refusal(model_type: str) -> str | None:
    """Why --target mlx refuses ``model_type``, or None."""
    return target_refusal(model_type, "mlx")


def mlx_arch_for(model_type: str | None) -> MlxArch:
    if (why := mlx_refusal(str(model_type))) is None:
        return MLX_ARCHS[str(model_type)]
    raise UserError(f"--target mlx does not know architecture {model_type!r} ({why})",
                    f"it exports: {', '.join(MLX_ARCHS)}")


def mlx_config(cfg: dict) -> tuple[dict, list[str]]:
    """``cfg`` as mlx-lm must read it, and the keys filled in."""
    out = dict(cfg)
    filled = [key for fix in mlx_arch_for(cfg.get("model_type")).config_fixes for key in fix(out)]
    return out, filled
