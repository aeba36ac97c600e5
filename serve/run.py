"""Start the gateway over the llama.cpp engine (``tuneport serve``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from convert.errors import UserError

from .gateway import create_app
from .pool import check_name
from .service import LlamaCppService
from .vllm_service import VllmOptions

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
    key = read_api_key(api_key_file)
    service = build(base, adapters, adapter_dir, max_adapters, pin, n_ctx, workers)
    run_gateway(service, key, host, port)


def vllm_options(base: str, adapters: list[str], adapter_dir: Path | None, max_adapters: int, pin: bool,
                 port: int, **kw) -> VllmOptions:
    """Options for the vLLM engine; vLLM listens on 127.0.0.1 at ``--engine-port`` (default: port + 1)."""
    named = parse_named(adapters)
    if len(named) > max_adapters:
        raise UserError(f"{len(named)} start-up adapters exceed --max-adapters {max_adapters}", "raise --max-adapters")
    engine_port = kw.pop("engine_port", None) or port + 1
    return VllmOptions(base=base, adapters=named, adapter_dir=adapter_dir, max_adapters=max_adapters, pin=pin,
                       port=engine_port, **kw)


def serve_vllm(opts: VllmOptions, host: str, port: int, api_key_file: Path | None, log_file: Path | None) -> None:
    from .vllm_service import VllmService

    key = read_api_key(api_key_file)
    service = VllmService(opts, log_path=log_file)
    run_gateway(service, key, host, port)


def run_gateway(service, key: str | None, host: str, port: int) -> None:
    import signal

    import uvicorn

    # uvicorn finishes in-flight requests on SIGINT/SIGTERM, then re-raises the signal to the handler it
    # found: make that a no-op so a graceful stop exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(create_app(service, api_key=key), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        service.close()


@dataclass
class ServeRequest:
    """``tuneport serve``'s options."""

    base: str
    adapters: list[str] = field(default_factory=list)
    adapter_dir: Path | None = None
    engine: str = "auto"
    max_adapters: int = 8
    pin: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    n_ctx: int = 2048
    workers: int = 2
    concurrency: int = 8
    max_model_len: int | None = None
    dtype: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_lora_rank: int | None = None
    max_loras: int | None = None
    engine_port: int | None = None
    guard: str = "auto"
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    replicas: int = 1
    gpus_per_replica: int = 1

    def vllm(self) -> VllmOptions:
        return vllm_options(self.base, self.adapters, self.adapter_dir, self.max_adapters, self.pin, self.port,
                            engine_port=self.engine_port, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                            dtype=self.dtype, max_model_len=self.max_model_len,
                            tensor_parallel_size=self.tensor_parallel_size,
                            pipeline_parallel_size=self.pipeline_parallel_size, extra_args=self.extra_args,
                            guard=self.guard)


def serve(req: ServeRequest, dry_run: bool = False) -> dict | None:
    """Pick the engine (``auto``: serve.policy), then serve; with ``dry_run`` return the plan instead."""
    from . import policy

    if req.extra_args and req.engine == "llamacpp":
        raise UserError(f"extra arguments {' '.join(req.extra_args)} are for vLLM", "drop them for --engine llamacpp")
    decision = None
    engine = req.engine
    if engine == "auto" or dry_run:
        decision = policy.choose_engine(policy.describe_artifact(req.base), policy.detect_hardware(),
                                        policy.ServeLoad(concurrency=req.concurrency,
                                                         n_adapters=len(req.adapters) + (1 if req.adapter_dir else 0),
                                                         context_len=req.max_model_len or req.n_ctx),
                                        policy.installed_engines())
        if engine == "auto":
            engine = decision.engine
    if dry_run:
        return policy_report(req, engine, decision)
    if engine == "llamacpp":
        serve_llamacpp(req.base, req.adapters, req.adapter_dir, req.max_adapters, req.pin, req.host, req.port,
                       req.api_key_file, req.n_ctx, req.workers)
    elif engine == "vllm":
        serve_vllm(req.vllm(), req.host, req.port, req.api_key_file, req.log_file)
    else:
        raise UserError(f"--engine {engine} is not served by this version of tuneport",
                        "export with --target gguf or vllm and serve with --engine llamacpp or vllm")
    return None


def policy_report(req: ServeRequest, engine: str, decision) -> dict:
    raise NotImplementedError  # filled in with serve.policy
