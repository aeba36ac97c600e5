"""Running ``tuneport serve``: pick the engine (``serve.policy``), start its backend, put the gateway in
front of it (:class:`Server`), or describe all that without starting anything (:func:`plan`)."""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tuneport.convert.errors import UserError
from tuneport.convert.options import coerce_options

from .launch import auto_decision, base_and_format, check_engine, expected_load, start_backend
from .limits import LIMIT_FLAGS
from .options import ServeOptions, option_flag
from .registry import engine_spec

if TYPE_CHECKING:  # `import tuneport` imports this module: engines and the web stack load when used
    from .backend import Backend

GRACEFUL_SHUTDOWN_S = 30
ENGINE_POLL_S = 0.5  # how often `tuneport serve` checks that its engine still serves


class EngineStopped(UserError):
    """The engine died under a running server (exit 1: not the user's input)."""

    exit_code = 1
log = logging.getLogger("tuneport.serve")


class Server:
    """A running ``tuneport serve``: the backend and its gateway on ``url`` (uvicorn in a thread).

    Use it as a context manager, or call :meth:`close`. ``port=0`` in the options picks a free port.
    """

    def __init__(self, opts: ServeOptions) -> None:
        import uvicorn

        from .gateway import create_app
        from .gateway.connections import ensure_file_descriptors, uvicorn_settings

        if dry := [k for k in ("replicas", "gpus_per_replica") if k in opts.changed()]:
            raise UserError(f"{option_flag(dry[0])} applies to --on ray and to the dry run",
                            "add --on ray to serve several replicas on Ray Serve, or --dry-run "
                            "(tuneport.serve_plan) to print their commands")
        gateway = opts.gateway_settings()  # the key files are read before the engine starts
        ensure_file_descriptors(gateway["limits"])
        self.options = opts
        self._lock = threading.Lock()
        self._closed = False
        sock = _listen(opts.host, opts.port)  # before the engine starts: a busy port fails at once
        self.backend: Backend | None = None
        try:
            self.backend = start_backend(opts)
            self.host, self.port = opts.host, sock.getsockname()[1]
            host = "127.0.0.1" if opts.host in ("0.0.0.0", "") else opts.host
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
            config = uvicorn.Config(create_app(self.backend, **gateway), log_level="warning",
                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                    **uvicorn_settings(gateway["limits"]))
            self._uvicorn = uvicorn.Server(config)
            self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True,
                                            name="tuneport-gateway")
            self._thread.start()
            while not self._uvicorn.started:
                if not self._thread.is_alive():
                    raise UserError("the gateway stopped while starting", "rerun with --log-level debug")
                time.sleep(0.02)
        except BaseException:
            sock.close()
            if self.backend is not None:
                if hasattr(self, "_thread"):
                    self._uvicorn.should_exit = True
                    self._thread.join(GRACEFUL_SHUTDOWN_S)
                self.backend.close()
            raise

    def wait(self) -> None:
        """Serve until :meth:`stop` is called (from a signal handler, say), or the engine dies: then one log
        line with the engine's own error and :class:`EngineStopped` (exit 1), or with ``restart_engine`` the
        engine is started again."""
        failure = None
        while self._thread.is_alive():
            self._thread.join(ENGINE_POLL_S)
            if failure is not None or (why := self.backend.failure()) is None:
                continue
            log.error("the %s engine stopped: %s", self.backend.engine, why)
            if self.options.restart_engine:
                try:
                    self.backend.restart()
                    log.warning("the %s engine was started again", self.backend.engine)
                    continue
                except Exception as e:  # noqa: BLE001 - whatever stopped the restart is the reason serve exits
                    why = f"{why}; restarting it failed: {e.line() if isinstance(e, UserError) else e!r}"
            failure = why
            self.stop()
        if failure is not None:
            raise EngineStopped(f"the {self.backend.engine} engine stopped: {failure}",
                                "see its log; --restart-engine starts vLLM again when it dies")

    def stop(self) -> None:
        """Ask the gateway to finish in-flight requests and stop (returns at once); asked again, stop now."""
        if self._uvicorn.should_exit:
            self._uvicorn.force_exit = True
        self._uvicorn.should_exit = True

    def close(self) -> None:
        """Stop the gateway (in-flight requests finish first), then the engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._uvicorn.should_exit = True
        self._thread.join(GRACEFUL_SHUTDOWN_S + 5)
        self.backend.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror})",
                        "pick another --port, or stop what uses it") from e
    return sock


def serve(options: ServeOptions | None = None, /, **fields) -> Server:
    """``tuneport serve`` in the background: the engine (``engine="auto"`` picks one), its adapters and the
    OpenAI-compatible gateway. Pass a :class:`ServeOptions` or its fields as keywords. Returns a running
    :class:`Server` with ``.url`` and ``.close()``, usable as a context manager; ``port=0`` picks a free port.
    With ``on="ray"`` a :class:`tuneport.serve.rayserve.server.RayServer` (same surface): replicas on Ray Serve."""
    opts = coerce_options(ServeOptions, options, fields)
    if opts.on == "ray":
        from .rayserve.server import RayServer

        return RayServer(opts)
    return Server(opts)


def serve_forever(opts: ServeOptions) -> None:
    """``tuneport serve``: serve until SIGINT/SIGTERM, then finish in-flight requests and stop (exit 0)."""
    with serve(opts) as server:
        if opts.on == "ray":
            replicas = f"{opts.min_replicas}-{opts.max_replicas}" if opts.min_replicas else str(opts.replicas)
            log.info("serving %s on %s (Ray Serve, %s replica(s) of %s)", opts.base, server.url, replicas,
                     server.engine)
        else:
            batching = server.backend.describe().get("adapter_batching")
            log.info("serving %s on %s (%s%s)", server.backend.name, server.url, server.backend.engine,
                     f"; adapters batched: {batching}" if batching else "")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: server.stop())
        server.wait()


def tuneport_argv(opts: ServeOptions, engine: str) -> list[str]:
    """The ``tuneport serve`` command line for ``opts`` with the engine decided (dry-run flags left out)."""
    argv = ["tuneport", "serve", "--engine", engine, "--base", opts.base]
    for name, path in opts.adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    if opts.adapter_dir:
        argv += ["--adapter-dir", str(opts.adapter_dir)]
    argv += ["--max-adapters", str(opts.max_adapters), "--host", opts.host, "--port", str(opts.port)]
    if not opts.pin:
        argv.append("--no-pin")
    if opts.api_key_file:
        argv += ["--api-key-file", str(opts.api_key_file)]
    given = opts.changed()
    for key in ("admin_key_file", "max_tokens_limit", "max_concurrent_per_key", *LIMIT_FLAGS):  # every engine's
        if getattr(opts, key) is not None and (key not in LIMIT_FLAGS or key in given):
            argv += [option_flag(key), f"{getattr(opts, key):g}" if isinstance(getattr(opts, key), float)
                     else str(getattr(opts, key))]
    if opts.dtype != "auto":
        argv += ["--dtype", opts.dtype]
    honoured = engine_spec(engine).options
    for key in honoured:
        if key == "vllm_args" or key not in given:
            continue
        argv += [option_flag(key)] if given[key] is True else [option_flag(key), str(given[key])]
    return argv + (["--", *opts.vllm_args] if "vllm_args" in given and "vllm_args" in honoured else [])


def plan(options: ServeOptions | None = None, /, **fields) -> dict:
    """``tuneport serve --dry-run``: the engine and why, the memory plan per engine and the exact commands,
    as a JSON-able dict. Starts and writes nothing."""
    from tuneport.convert.adapter import resolve_adapter_path

    from . import policy
    from .backends.vllm import VllmPlan
    from .vllm_bugs import GUARD_ADAPTER

    opts = coerce_options(ServeOptions, options, fields)
    path, fmt = base_and_format(opts)
    try:
        auto = auto_decision(opts, path, fmt)
    except UserError as e:
        if opts.engine == "auto":
            raise
        auto = policy.EngineDecision("", f"auto would refuse: {e.line()}")
    engine = auto.engine if opts.engine == "auto" else opts.engine
    check_engine(opts, engine, fmt, starting=False)
    artifact, load = policy.describe_artifact(path), expected_load(opts)
    startup = [resolve_adapter_path(p) for p in opts.adapters.values()]
    plans, notes = {}, []
    vllm_plan = None
    if artifact.format in engine_spec("vllm").formats:
        try:
            vllm_plan = VllmPlan(opts, write=False)
        except UserError as e:
            if engine == "vllm":
                raise
            notes.append(f"vLLM: {e.line()}")
    for name in ("llamacpp", "vllm", "mlx", "exllamav3"):
        if artifact.format not in engine_spec(name).formats and {"mlx", "exl3", "exllamav3"} & {name, artifact.format}:
            continue  # MLX and EXL3 directories pair only with their own engine: no note either
        try:
            if name == "vllm" and vllm_plan is not None:
                launch = vllm_plan.launch
                plans[name] = policy.memory_plan(
                    name, artifact, load, adapter_bytes=[policy.adapter_nbytes(p, name, artifact.dtype_bytes)
                                                         for p in startup],
                    max_lora_rank=launch.max_lora_rank, adapter_slots=launch.adapter_slots,
                    dtype=launch.dtype, tensor_parallel_size=opts.tensor_parallel_size,
                    pipeline_parallel_size=opts.pipeline_parallel_size)
            elif name == "llamacpp":
                plans[name] = policy.memory_plan(
                    name, artifact, dataclasses.replace(load, context_len=opts.n_ctx), contexts=opts.contexts,
                    adapter_bytes=[policy.adapter_nbytes(p, name) for p in startup], dtype=opts.dtype,
                    kv_bytes_per_elem=4 if opts.kv_f32 else None, gpu_layers=_planned_gpu_layers(opts, notes))
            elif name == "exllamav3":
                plans[name] = policy.memory_plan(name, artifact, dataclasses.replace(load, context_len=opts.n_ctx),
                                                 adapter_bytes=[policy.adapter_nbytes(p, name) for p in startup])
            elif name == "mlx":
                plans[name] = policy.memory_plan(
                    name, artifact, dataclasses.replace(load, context_len=opts.n_ctx),
                    adapter_bytes=[policy.adapter_nbytes(p, name) for p in startup], dtype=opts.dtype)
        except UserError as e:
            notes.append(f"{name}: {e.line()}")
    decision = auto
    if opts.engine != "auto":
        would = f"auto would choose {auto.engine}: {auto.reason}" if auto.engine else auto.reason
        decision = policy.EngineDecision(engine, f"--engine {engine} as asked ({would})", "explicit")
    argv = tuneport_argv(opts, engine)
    if opts.on == "ray":
        from .rayserve.proxy import proxy_environment
        from .rayserve.server import write_deploy_files

        files = write_deploy_files(opts, engine, opts.deploy_dir or Path("tuneport-ray"))
        token = {"RAY_AUTH_MODE": "token"}  # Ray 2.60 turns it on wherever ~/.ray/auth_token exists: say so always
        commands = [
            {"what": "Ray's authentication token, made once in ~/.ray/auth_token (copy it to every node)", "env": {},
             "argv": ["ray", "get-auth-token", "--generate"]},
            {"what": "start Ray's head with tuneport's HTTP limits in Ray Serve's proxy (other nodes: ray start "
                     "--address HEAD:6379 with the same variables)",
             "env": {**token, **proxy_environment(opts.http_limits())}, "argv": ["ray", "start", "--head"]},
            {"what": "deploy on that Ray cluster (Ray Serve's own CLI, through the head's dashboard)", "env": token,
             "argv": ["serve", "deploy", files["serve_config"]]},
            {"what": "or on Kubernetes with KubeRay (an image with tuneport installed; base and adapters mounted at "
                     "the same paths)", "env": {}, "argv": ["kubectl", "apply", "-f", files["rayservice"]]}]
        notes.append(f"wrote {files['serve_config']} (Ray Serve config) and {files['rayservice']} (KubeRay "
                     "RayService)")
    elif opts.replicas > 1:
        gpus = 1 if opts.gpus_per_replica is None else int(opts.gpus_per_replica)
        commands = policy.replica_commands(argv, opts.replicas, gpus, opts.port)
        ports = [int(c["argv"][c["argv"].index("--port") + 1]) for c in commands]
        notes.append("load balancer (nginx, inside http {}):\n" + policy.nginx_upstream(ports, opts.port - 1))
    else:
        commands = [{"what": "tuneport (gateway + adapter pool)", "env": {}, "argv": argv}]
    if engine == "vllm" and vllm_plan is not None:
        launch = vllm_plan.launch
        what = "the vLLM server tuneport starts (127.0.0.1 only)"
        if opts.replicas > 1:
            what += "; shown for replica 1, the others listen on their own port + 1"
        commands.append({"what": what, "env": launch.env(), "argv": ["python", *launch.command()[1:]]})
        if vllm_plan.guard:
            notes.append(f"base requests go to vLLM as the zero adapter {GUARD_ADAPTER!r} "
                         f"(known bug: {vllm_plan.bugs[0].key}, {vllm_plan.bugs[0].upstream}); "
                         "one extra LoRA slot holds it")
    if engine == "exllamav3" and opts.tabby_dir is not None:
        commands.append(_tabby_command(opts, path))
    return policy.dry_run(decision, plans, commands, notes)


def _planned_gpu_layers(opts: ServeOptions, notes: list[str]) -> int:
    """llama.cpp's n_gpu_layers the plan counts: as serve would resolve it here, or as asked (with a note) where
    this machine's llama.cpp could not offload it."""
    from tuneport.convert.gguf.gpu import ALL, n_gpu_layers

    asked = -1 if opts.gpu_layers == ALL else int(opts.gpu_layers or 0)
    if not engine_spec("llamacpp").installed():
        return asked
    try:
        return n_gpu_layers(opts.gpu_layers)
    except UserError as e:
        notes.append(f"llama.cpp: {e.line()}")
        return asked


def _tabby_command(opts: ServeOptions, model: Path) -> dict:
    """The TabbyAPI server ``serve --engine exllamav3`` starts, with the config it writes (shown in full)."""
    import yaml

    from tuneport.convert.exl3.tabby import tabby_config

    from .backends.exllamav3 import engine_port, tabby_launch

    config = tabby_config(model, opts.n_ctx, cache_size=opts.n_ctx * opts.concurrency, port=engine_port(opts))
    tabby = opts.tabby_dir or Path("TABBY_DIR")
    return {"what": f"TabbyAPI, run in {tabby} (127.0.0.1 only), with this config.yml:\n"
                    + yaml.safe_dump(config, sort_keys=False).rstrip(),
            "env": {}, "argv": ["python", *tabby_launch(tabby, Path("TABBY_CONFIG.yml"))[1:]]}
