"""What every writer starts from: the output path free, the base opened and fit for its target, the adapters
loaded (and renamed for a multimodal model's text view); and the progress callback writers report to."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import UserError
from .options import AdapterSpec, MergeOptions
from .targets import check_base

if TYPE_CHECKING:
    from .adapter import Adapter
    from .checkpoint import Checkpoint
    from .merge import WeightedAdapter

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current item)


def load_weighted(adapters: list[AdapterSpec], allow_pickle: bool = False) -> list[WeightedAdapter]:
    from .adapter import load_adapter
    from .merge import WeightedAdapter

    loaded = [WeightedAdapter(load_adapter(a.path, a.name, allow_pickle), a.weight) for a in adapters]
    names = [w.adapter.name for w in loaded]
    if len(set(names)) != len(names):
        raise UserError(f"two adapters share the name {names}", "name them: --adapter NAME=PATH")
    return loaded


def open_inputs(opts: MergeOptions, target: str) -> tuple[Checkpoint, list[WeightedAdapter]]:
    """What every writer starts with: the output path free (or --force), the base opened and fit for
    ``target``, the adapters loaded."""
    from .atomic import check_output_path
    from .checkpoint import Checkpoint
    from .merge import WeightedAdapter

    check_output_path(opts.out, opts.force)
    ckpt = Checkpoint(opts.base, allow_pickle=opts.allow_pickle)
    view = check_base(ckpt, target)
    loaded = load_weighted(opts.adapters, opts.allow_pickle)
    loaded = [WeightedAdapter(adapter_for(w.adapter, ckpt, view, target), w.weight) for w in loaded]
    return view, loaded


def adapter_for(adapter: Adapter, ckpt: Checkpoint, view: Checkpoint, target: str) -> Adapter:
    """``adapter`` for the checkpoint ``target`` exports (``view``, from ``check_base``): renamed for a
    multimodal model's text view (an adapter on its vision tower refused there)."""
    from .multimodal import text_tower_adapter

    return adapter if view is ckpt else text_tower_adapter(adapter, ckpt.model_type, target)


