"""`tuneport serve`: pick the engine (serve.policy), print the dry-run plan, or run the gateway over an engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from convert.errors import UserError

from .gateway import create_app
from .pool import check_name
from .service import LlamaCppService
from .vllm_bugs import GUARD_ADAPTER
from .vllm_service import VllmOptions, VllmPlan

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


def startup_adapters(specs: list[str], max_adapters: int, must_fit: bool) -> list[tuple[str, Path]]:
    """``--adapter`` specs as (name, path); refused when they must all stay loaded but exceed the pool."""
    named = parse_named(specs)
    if must_fit and len(named) > max_adapters:
        raise UserError(f"{len(named)} start-up adapters exceed --max-adapters {max_adapters}",
                        "raise --max-adapters (or pass --no-pin on the llama.cpp engine)")
    return named


def build(base: str, adapters: list[str], adapter_dir: Path | None, max_adapters: int, pin: bool,
          n_ctx: int = 2048, workers: int = 2, kv_f32: bool = False) -> LlamaCppService:
    named = startup_adapters(adapters, max_adapters, must_fit=pin)
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
        """Options for the vLLM engine; vLLM listens on 127.0.0.1 at ``--engine-port`` (default: port + 1).
        vLLM registers every start-up adapter, so they must fit the pool even with --no-pin."""
        return VllmOptions(
            base=self.base, adapters=startup_adapters(self.adapters, self.max_adapters, must_fit=True),
            adapter_dir=self.adapter_dir, max_adapters=self.max_adapters, pin=self.pin,
            port=self.engine_port or self.port + 1, max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
            dtype=self.dtype, max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size, extra_args=self.extra_args, guard=self.guard)


def serve(req: ServeRequest, dry_run: bool = False) -> dict | None:
    """Pick the engine (``auto``: serve.policy), then serve; with ``dry_run`` return the plan instead."""
    from . import policy

    if req.extra_args and req.engine == "llamacpp":
        raise UserError(f"extra arguments {' '.join(req.extra_args)} are for vLLM", "drop them for --engine llamacpp")
    engine = req.engine
    if engine == "auto" or dry_run:
        artifact = policy.describe_artifact(req.base)
        load = policy.ServeLoad(concurrency=req.concurrency, context_len=req.max_model_len or req.n_ctx,
                                n_adapters=len(req.adapters) + (1 if req.adapter_dir else 0))
        decision = policy.choose_engine(artifact, policy.detect_hardware(), load, policy.installed_engines())
        if engine == "auto":
            engine = decision.engine
        if dry_run:
            return policy_report(req, engine, decision, artifact, load)
    if engine == "llamacpp":
        serve_llamacpp(req.base, req.adapters, req.adapter_dir, req.max_adapters, req.pin, req.host, req.port,
                       req.api_key_file, req.n_ctx, req.workers)
    elif engine == "vllm":
        serve_vllm(req.vllm(), req.host, req.port, req.api_key_file, req.log_file)
    else:
        raise UserError(f"--engine {engine} is not served by this version of tuneport",
                        "export with --target gguf or vllm and serve with --engine llamacpp or vllm")
    return None


def tuneport_argv(req: ServeRequest, engine: str) -> list[str]:
    """The ``tuneport serve`` command line for ``req`` with the engine decided (dry-run flags left out)."""
    argv = ["tuneport", "serve", "--engine", engine, "--base", req.base]
    for a in req.adapters:
        argv += ["--adapter", a]
    if req.adapter_dir:
        argv += ["--adapter-dir", str(req.adapter_dir)]
    argv += ["--max-adapters", str(req.max_adapters), "--host", req.host, "--port", str(req.port)]
    if not req.pin:
        argv.append("--no-pin")
    if req.api_key_file:
        argv += ["--api-key-file", str(req.api_key_file)]
    if engine == "llamacpp":
        return argv + ["--n-ctx", str(req.n_ctx), "--workers", str(req.workers)]
    optional = {"--max-model-len": req.max_model_len, "--dtype": req.dtype, "--max-lora-rank": req.max_lora_rank,
                "--max-loras": req.max_loras, "--engine-port": req.engine_port,
                "--tensor-parallel-size": req.tensor_parallel_size if req.tensor_parallel_size > 1 else None,
                "--pipeline-parallel-size": req.pipeline_parallel_size if req.pipeline_parallel_size > 1 else None,
                "--vllm-base-guard": req.guard if req.guard != "auto" else None}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--", *req.extra_args] if req.extra_args else [])


def policy_report(req: ServeRequest, engine: str, decision, artifact, load) -> dict:
    """``--dry-run``: the engine and why, the memory plan per engine, the exact command(s)."""
    from . import policy

    named = parse_named(req.adapters)
    plans, notes = {}, []
    vllm_plan = None
    if artifact.format != "gguf":
        try:
            vllm_plan = VllmPlan(req.vllm())
        except UserError as e:
            if engine == "vllm":
                raise
            notes.append(f"vLLM: {e.line()}")
    for name in ("llamacpp", "vllm"):
        try:
            if name == "vllm" and vllm_plan is not None:
                launch = vllm_plan.launch
                plans[name] = policy.memory_plan(
                    name, artifact, load, adapter_bytes=[policy.adapter_nbytes(p, name, artifact.dtype_bytes)
                                                         for _, p in named],
                    max_lora_rank=launch.max_lora_rank, adapter_slots=launch.adapter_slots, dtype=req.dtype,
                    tensor_parallel_size=req.tensor_parallel_size, pipeline_parallel_size=req.pipeline_parallel_size)
            elif name == "llamacpp":
                plans[name] = policy.memory_plan(
                    name, artifact, dataclasses.replace(load, context_len=req.n_ctx), workers=req.workers,
                    adapter_bytes=[policy.adapter_nbytes(p, name) for _, p in named])
        except UserError as e:
            notes.append(f"{name}: {e.line()}")
    if req.engine != "auto":
        decision = policy.EngineDecision(engine, f"--engine {engine} as asked (auto would choose "
                                                 f"{decision.engine}: {decision.reason})", "explicit")
    argv = tuneport_argv(req, engine)
    if req.replicas > 1:
        commands = policy.replica_commands(argv, req.replicas, req.gpus_per_replica, req.port)
        ports = [int(c["argv"][c["argv"].index("--port") + 1]) for c in commands]
        notes.append("load balancer (nginx, inside http {}):\n" + policy.nginx_upstream(ports, req.port - 1))
    else:
        commands = [{"what": "tuneport (gateway + adapter pool)", "env": {}, "argv": argv}]
    if engine == "vllm" and vllm_plan is not None:
        launch = vllm_plan.launch
        what = "the vLLM server tuneport starts (127.0.0.1 only)"
        if req.replicas > 1:
            what += "; shown for replica 1, the others listen on their own port + 1"
        commands.append({"what": what, "env": launch.env(),
                         "argv": ["python", *launch.command()[1:]]})
        if vllm_plan.guard:
            notes.append(f"base requests go to vLLM as the zero adapter {GUARD_ADAPTER!r} "
                         f"(known bug: {vllm_plan.bugs[0].key}, {vllm_plan.bugs[0].upstream}); "
                         "one extra LoRA slot holds it")
    return policy.dry_run(decision, plans, commands, notes)
