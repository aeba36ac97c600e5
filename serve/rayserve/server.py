"""``tuneport serve --on ray``: check everything, join the Ray cluster at ``--ray-address`` (or start one here),
deploy the application and serve until stopped; then delete it (in-flight requests finish first)."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from tuneport.convert.errors import UserError

from ..engines.child import free_port
from ..options import ServeOptions
from .config import APP_NAME, autoscaling
from .proxy import proxy_environment

log = logging.getLogger("tuneport.serve")
INSTALL_HINT = "pip install 'tuneport[ray]' (Ray Serve 2.60.0)"


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise UserError("--on ray needs Ray Serve, which is not installed here", INSTALL_HINT) from e


def deploy_failure(e: Exception) -> str:
    """The line that says why a deployment failed: the last exception line in its deployments' messages."""
    from ray import serve

    text = str(e)
    try:
        app = serve.status().applications.get(APP_NAME)
        text += "\n" + "\n".join(d.message for d in (app.deployments.values() if app else []) if d.message)
    except Exception:  # noqa: BLE001 - the controller gone too: Ray's own message
        pass
    lines = [m.group(0) for m in re.finditer(r"^[\w.]*(Error|Exception): .+$", text, re.M)]
    return lines[-1] if lines else text.strip().splitlines()[-1]


def _serve_port(opts: ServeOptions) -> int:
    """Start Serve's HTTP proxy on ``--host``/``--port`` (port 0: a free one), or, where Serve runs already on the
    cluster, the port it listens on (refused when ``--port`` asks for another)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        port = opts.port or free_port(opts.host)
        serve.start(http_options={"host": opts.host, "port": port})
        return port
    running = client.http_config.port
    if opts.port and opts.port != running:
        raise UserError(f"Ray Serve runs on this cluster already, listening on port {running}, not --port {opts.port}",
                        f"pass --port {running} (or 0), or shut that Serve instance down (serve shutdown)")
    return running


def check_resources(opts: ServeOptions, cpus: float, gpus: float, where: str) -> None:
    """Refuse replicas the cluster can never place (Ray would wait for them forever)."""
    count = opts.min_replicas if autoscaling(opts) else opts.replicas
    want_gpus = (opts.gpus_per_replica or 0) * count
    if want_gpus > gpus:
        raise UserError(f"{count} replica(s) x --gpus-per-replica {opts.gpus_per_replica:g} = {want_gpus:g} GPUs, "
                        f"but {where} has {gpus:g}", "lower --gpus-per-replica or the replicas, or add GPU nodes")
    if opts.cpus_per_replica * count > cpus:
        raise UserError(f"{count} replica(s) x --cpus-per-replica {opts.cpus_per_replica:g} = "
                        f"{opts.cpus_per_replica * count:g} CPUs, but {where} has {cpus:g}",
                        "lower --cpus-per-replica (e.g. 0.5) or the replicas, or add nodes")


def preflight(opts: ServeOptions) -> str:
    """Everything checked before Ray starts (ServeOptions checked the rest): Ray installed, the engine and its
    options, the key files; the engine ``auto`` chooses."""
    from ..launch import auto_decision, base_and_format, check_engine

    require_ray()
    opts.gateway_settings()
    path, fmt = base_and_format(opts)
    engine = auto_decision(opts, path, fmt).engine if opts.engine == "auto" else opts.engine
    check_engine(opts, engine, fmt, starting=opts.ray_address is None)
    return engine


class RayServer:
    """A running ``tuneport serve --on ray``: ``url``, ``wait()``, ``close()``; a context manager, as
    :class:`tuneport.serve.server.Server`. ``multiplex=False`` routes requests to any replica (to compare)."""

    def __init__(self, opts: ServeOptions, multiplex: bool = True) -> None:
        engine = preflight(opts)
        import ray
        from ray import serve

        from ..policy import detect_hardware
        from .app import build
        from .config import app_options

        self.options, self.engine = opts, engine
        self._started_ray = False
        if opts.ray_address is None:
            check_resources(opts, os.cpu_count() or 1, detect_hardware().n_gpus, "this machine")
        if not ray.is_initialized():
            quiet = logging.getLogger("tuneport").getEffectiveLevel() > logging.DEBUG
            if opts.ray_address is None:  # the cluster started here inherits them: its HTTP proxy holds our limits
                os.environ.update(proxy_environment(opts.http_limits()))
            ray.init(address=opts.ray_address, include_dashboard=False, log_to_driver=not quiet,
                     logging_level=logging.WARNING, configure_logging=True)
            self._started_ray = opts.ray_address is None
        if opts.ray_address is not None:
            resources = ray.cluster_resources()
            check_resources(opts, resources.get("CPU", 0), resources.get("GPU", 0), "the Ray cluster")
        port = _serve_port(opts)
        try:
            serve.run(build({"options": app_options(opts, engine), "multiplex": multiplex}), name=APP_NAME,
                      route_prefix="/", blocking=False)
        except Exception as e:  # a replica that could not start: Ray's message names the engine's error
            why = deploy_failure(e)
            self._shutdown()
            raise UserError(f"the Ray Serve application did not start: {why}",
                            "see the replicas' logs under /tmp/ray/session_latest/logs/serve") from e
        host = "127.0.0.1" if opts.host in ("0.0.0.0", "") else opts.host
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._stop = threading.Event()
        self._closed = False

    def wait(self) -> None:
        """Serve until :meth:`stop`; Ray restarts replicas that fail their health check meanwhile."""
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    def _shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.delete(APP_NAME)  # replicas finish in-flight requests (graceful_shutdown_timeout_s)
        finally:
            if self._started_ray:
                serve.shutdown()
                ray.shutdown()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._shutdown()

    def __enter__(self) -> RayServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_deploy_files(opts: ServeOptions, engine: str, out: Path) -> dict[str, str]:
    """``--dry-run --on ray``: the Serve config (``serve deploy``) and the KubeRay manifest, side by side in
    ``out``; their paths."""
    import yaml

    from tuneport.convert.atomic import write_text_atomic

    from .config import rayservice_manifest, serve_config

    out.mkdir(parents=True, exist_ok=True)
    files = {"serve_config": out / "serve_config.yaml", "rayservice": out / "rayservice.yaml"}
    write_text_atomic(files["serve_config"], yaml.safe_dump(serve_config(opts, engine), sort_keys=False))
    write_text_atomic(files["rayservice"], yaml.safe_dump(rayservice_manifest(opts, engine), sort_keys=False))
    return {k: str(v) for k, v in files.items()}
