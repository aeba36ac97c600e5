"""The Ray Serve application as data: its deployments' settings, the Serve config file (``serve deploy``) and the
KubeRay ``RayService`` manifest for the same application. Imports nothing of Ray."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from ..options import RAY_ONLY, ServeOptions
from .proxy import proxy_environment

APP_NAME = "tuneport"
IMPORT_PATH = "tuneport.serve.rayserve.app:build"
INGRESS, REPLICA, CATALOG = "OpenAIIngress", "AdapterReplica", "AdapterCatalog"
RAY_VERSION = "2.60.0"  # the pin of the `ray` extra: the version the manifest's cluster runs
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
GRACEFUL_SHUTDOWN_S = 30.0
REPLICA_ONLY_DROPPED = ("on", "host", "port", "replicas", *RAY_ONLY, "gpus_per_replica")


def _absolute(path: str) -> str:
    """A local path made absolute (replicas run in other directories); a hub id as it is."""
    p = Path(path).expanduser()
    return str(p.absolute()) if p.exists() else path


def app_options(opts: ServeOptions, engine: str) -> dict:
    """``opts`` as the JSON-able ``args`` of the application (what its builder turns back into ServeOptions), with
    the engine decided and local paths absolute."""
    out: dict = {"base": _absolute(opts.base), "engine": engine}
    for f in fields(opts):
        value = getattr(opts, f.name)
        if f.name in ("base", "engine") or f.name not in opts.changed():
            continue
        if f.name == "adapters":
            value = {name: _absolute(path) for name, path in value.items()}
        out[f.name] = str(Path(value).absolute()) if isinstance(value, Path) else value
    return out


def replica_options(opts: ServeOptions) -> ServeOptions:
    """What one replica's engine runs: the same options, served in this process (any free engine port)."""
    kept = {f.name: getattr(opts, f.name) for f in fields(opts) if f.init and f.name not in REPLICA_ONLY_DROPPED}
    return ServeOptions(**kept, port=0)


def autoscaling(opts: ServeOptions) -> bool:
    return opts.min_replicas is not None


def deployment_settings(opts: ServeOptions) -> dict[str, dict]:
    """Each deployment's Ray Serve settings (``Deployment.options`` keywords, and the Serve config's
    ``deployments`` entries)."""
    replica: dict = {
        "name": REPLICA,
        "ray_actor_options": {"num_cpus": opts.cpus_per_replica, "num_gpus": opts.gpus_per_replica or 0},
        "max_ongoing_requests": max(2, opts.concurrency),  # the engine batches what it holds
        "health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S, "graceful_shutdown_wait_loop_s": 1.0,
    }
    if autoscaling(opts):
        replica["autoscaling_config"] = {
            "min_replicas": opts.min_replicas, "max_replicas": opts.max_replicas,
            "initial_replicas": opts.min_replicas, "target_ongoing_requests": opts.target_ongoing_requests,
            "upscale_delay_s": opts.upscale_delay_s, "downscale_delay_s": opts.downscale_delay_s,
            "metrics_interval_s": 1.0, "look_back_period_s": 5.0}
    else:
        replica["num_replicas"] = opts.replicas
    def light(name: str) -> dict:  # a dict each: YAML would write a shared one as an anchor and an alias
        return {"name": name, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 1000,
                "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S}

    return {INGRESS: light(INGRESS), REPLICA: replica, CATALOG: light(CATALOG)}


def serve_config(opts: ServeOptions, engine: str) -> dict:
    """The Serve config file (``serve deploy`` / ``serve run`` read it; Ray's ``ServeDeploySchema``)."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": opts.host, "port": opts.port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
            "args": {"options": app_options(opts, engine)},
            "deployments": list(deployment_settings(opts).values()),
        }],
    }


def rayservice_manifest(opts: ServeOptions, engine: str, name: str = "tuneport") -> dict:
    """A KubeRay ``RayService`` running the same application: a head pod (ingress, catalog, controller) and one
    worker group sized for the replicas. The image must hold tuneport with the engine's extra, and the base and
    adapter paths must be mounted at the same paths in every pod."""
    config = serve_config(opts, engine)
    config.pop("http_options")  # KubeRay exposes the Serve port (8000) itself
    gpus = opts.gpus_per_replica or 0
    image = f"rayproject/ray:{RAY_VERSION}-py311{'-gpu' if gpus else '-cpu'}"
    cpus = str(max(1, math.ceil(opts.cpus_per_replica)))
    limits = {"cpu": cpus, "memory": "8Gi", **({"nvidia.com/gpu": str(math.ceil(gpus))} if gpus else {})}
    count = opts.min_replicas if autoscaling(opts) else opts.replicas
    most = opts.max_replicas if autoscaling(opts) else opts.replicas

    env = [{"name": k, "value": v} for k, v in proxy_environment(opts.http_limits()).items()]

    def pod(container: str, resources: dict) -> dict:  # every node runs a Serve proxy: each gets the limits
        return {"spec": {"containers": [{"name": container, "image": image, "resources": resources, "env": env,
                                         "ports": [{"containerPort": 8000, "name": "serve"}]
                                         if container == "ray-head" else []}]}}

    import yaml

    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "tuneport"}},
        "spec": {
            "serveConfigV2": yaml.safe_dump(config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": autoscaling(opts),
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                                  "template": pod("ray-head", {"limits": {"cpu": "1", "memory": "4Gi"},
                                                               "requests": {"cpu": "1", "memory": "4Gi"}})},
                "workerGroupSpecs": [{
                    "groupName": "replicas", "replicas": count, "minReplicas": count, "maxReplicas": most,
                    "rayStartParams": {},
                    "template": pod("ray-worker", {"limits": limits, "requests": limits}),
                }],
            },
        },
    }
