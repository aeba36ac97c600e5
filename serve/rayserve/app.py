"""The application builder: ``build(args)`` is the Serve config's ``import_path``
(``tuneport.serve.rayserve.app:build``) and what ``tuneport serve --on ray`` runs. Three deployments: the OpenAI
ingress (the gateway over a :class:`~.router.ReplicaRouter`), the replicas (engine + pool each) and the catalog."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ray import serve
from ray.serve import Application

from ..options import ServeOptions
from .catalog import AdapterCatalog
from .config import CATALOG, INGRESS, REPLICA, deployment_settings
from .replica import replica_class
from .router import ReplicaRouter


class OpenAIIngress:
    """The gateway (``create_app``: routes, keys, limits, access log) over the replicas."""

    async def __init__(self, options: dict, replicas, catalog, multiplex: bool = True) -> None:
        from tuneport.convert.adapter import resolve_adapter_path

        opts = ServeOptions(**options)
        self.gateway = opts.gateway_settings()
        info = await replicas.describe.remote()
        roots = [p for p in [opts.adapter_dir] if p is not None]
        roots += [resolve_adapter_path(p) for p in opts.adapters.values()]
        self.router = ReplicaRouter(info, replicas, catalog, [Path(r) for r in roots], list(opts.adapters),
                                    multiplex=multiplex, adapter_dir=opts.adapter_dir)
        self.router.live = await catalog.live.remote()
        self.router._watch = asyncio.get_running_loop().create_task(self.router.watch())

    def __serve_build_asgi_app__(self):
        from ..gateway import create_app

        return create_app(self.router, **self.gateway)

    def __del__(self) -> None:
        if hasattr(self, "router"):
            self.router.close()


def build(args: dict) -> Application:
    """The application for ``args = {"options": ServeOptions fields}`` (engine decided; see
    :func:`.config.app_options`): Ray Serve's application builder, one parameter (``serve deploy`` and ``serve run``
    call it with the config's ``args``). ``"multiplex": False`` in ``args`` sends requests to any replica (Ray's
    default routing), for comparing adapter loads."""
    multiplex = bool(args.get("multiplex", True))
    opts = ServeOptions(**args["options"])
    settings = deployment_settings(opts)
    catalog = serve.deployment(AdapterCatalog).options(**settings[CATALOG]).bind()
    replicas = serve.deployment(replica_class(opts.max_adapters)).options(**settings[REPLICA]).bind(
        args["options"], catalog)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress)).options(**settings[INGRESS])
    return ingress.bind(args["options"], replicas, catalog, multiplex)
