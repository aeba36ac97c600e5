"""Start the gateway over the llama.cpp engine (``tuneport serve``)."""

from __future__ import annotations

from pathlib import Path

from convert.errors import UserError

from .gateway import create_app
from .pool import check_name
from .service import LlamaCppService

GRACEFUL_SHUTDOWN_S = 30


def parse_named(specs: list[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            path, name = spec, Path(spec).stem if spec.endswith(".gguf") else Path(spec).name
        out.append((check_name(name), Path(path).expanduser()))
    return out


def read_api_key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise UserError(f"cannot read --api-key-file {path} ({e.strerror})", "pass a readable file") from e
    if not key:
        raise UserError(f"--api-key-file {path} is empty", "write the key into it")
    return key


def build(base: str, adapters: list[str], adapter_dir: Path | None, max_adapters: int, pin: bool,
          n_ctx: int = 2048, workers: int = 2, kv_f32: bool = False) -> LlamaCppService:
    named = parse_named(adapters)
    if len(named) > max_adapters and pin:
        raise UserError(f"{len(named)} pinned start-up adapters exceed --max-adapters {max_adapters}",
                        "raise --max-adapters or pass --no-pin")
    service = LlamaCppService(base, max_adapters=max_adapters, adapter_dir=adapter_dir, n_ctx=n_ctx,
                              n_workers=workers, kv_f32=kv_f32)
    try:
        for name, path in named:
            service.pool.add(name, path, pinned=pin, trusted=True)
    except BaseException:
        service.close()
        raise
    return service


def serve_llamacpp(base: str, adapters: list[str], adapter_dir: Path | None, max_adapters: int, pin: bool,
                   host: str, port: int, api_key_file: Path | None, n_ctx: int, workers: int) -> None:
    import signal

    import uvicorn

    key = read_api_key(api_key_file)
    service = build(base, adapters, adapter_dir, max_adapters, pin, n_ctx, workers)
    # uvicorn finishes in-flight requests on SIGINT/SIGTERM, then re-raises the signal to the handler it
    # found: make that a no-op so a graceful stop exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(create_app(service, api_key=key), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        service.close()
