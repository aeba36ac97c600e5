"""Which engine serves ``opts`` and starting it: the base's format, ``--engine auto``'s choice, every check an engine
makes before it starts, and the started backend. Used by ``tuneport serve`` here and by each Ray replica."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tuneport.convert.errors import UserError

from .options import ServeOptions
from .registry import check_engine_options, check_serves, engine_spec

if TYPE_CHECKING:  # engines load when used
    from .backend import Backend
    from .policy import EngineDecision

log = logging.getLogger("tuneport.serve")


def base_and_format(opts: ServeOptions) -> tuple[Path, str]:
    """The base's local path (a hub id is downloaded) and its format (serve.policy.FORMATS)."""
    from tuneport.convert.checkpoint import resolve_model_path

    from .policy import artifact_format

    path = resolve_model_path(opts.base)
    return path, artifact_format(path)


def expected_load(opts: ServeOptions):
    """The expected load (``serve.policy.ServeLoad``): what the engine choice and the memory plan size for."""
    from .policy import ServeLoad

    return ServeLoad(concurrency=opts.concurrency, context_len=opts.max_model_len or opts.n_ctx,
                     n_adapters=len(opts.adapters) + (1 if opts.adapter_dir else 0))


def auto_decision(opts: ServeOptions, path: Path, fmt: str) -> EngineDecision:
    """What ``--engine auto`` chooses for this base on this machine (the policy's rule table)."""
    from . import policy

    return policy.choose_engine(policy.ArtifactInfo(str(path), fmt), policy.detect_hardware(), expected_load(opts),
                                policy.installed_engines())


def check_engine(opts: ServeOptions, engine: str, fmt: str, *, starting: bool) -> None:
    """Everything that would make ``engine`` refuse ``opts``, checked before it starts (or is planned)."""
    spec = engine_spec(engine)
    if starting and not spec.installed():
        raise UserError(f"{spec.label} (--engine {engine}) is not installed here", spec.install_hint)
    check_serves(engine, fmt, opts.base)
    check_engine_options(opts, engine)
    spec.load_backend().check_options(opts, fmt)


def start_backend(opts: ServeOptions) -> Backend:
    """The engine ``opts`` names (or ``auto`` chooses) running the base with its start-up adapters loaded."""
    path, fmt = base_and_format(opts)
    engine = opts.engine
    if engine == "auto":
        decision = auto_decision(opts, path, fmt)
        engine = decision.engine
        log.info("engine %s: %s", engine, decision.reason)
    check_engine(opts, engine, fmt, starting=True)
    return engine_spec(engine).load_backend().from_options(opts)
