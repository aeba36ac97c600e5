"""tuneport's HTTP limits in Ray Serve's own HTTP proxy, the process that reads what clients send on Ray.

Ray's proxy reads a request's body as fast as the client sends it and queues it for the replica, without a bound;
the ingress's gateway refuses an oversized body only once it has pulled it from there. Ray calls a function named
by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` in each proxy as it starts, for middleware to put in front of its
app: :func:`proxy_middlewares` returns :class:`~tuneport.serve.gateway.body_limit.BodyLimit`, so the body is
bounded in the proxy itself, and sets the proxy's HTTP protocol (uvicorn's ``auto``, which Ray asks for) to
tuneport's (:mod:`tuneport.serve.gateway.connections`): headers, slow clients, idle connections and slow readers
as ``tuneport serve`` holds them. The limits travel in ``TUNEPORT_HTTP_LIMITS`` (JSON); both variables must be set
where the proxy starts: ``ray start`` on each node (``tuneport serve --on ray`` sets them for the cluster it starts).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from ..limits import HttpLimits

log = logging.getLogger("tuneport.serve.ray")
CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "tuneport.serve.rayserve.proxy:proxy_middlewares"
LIMITS_VARIABLE = "TUNEPORT_HTTP_LIMITS"
PROTOCOL = "tuneport.serve.rayserve.proxy:ProxyProtocol"
ProxyProtocol = None  # the protocol class with the limits, made by proxy_middlewares (uvicorn imports it by name)


def proxy_environment(limits: HttpLimits) -> dict[str, str]:
    """The variables a Ray node's ``ray start`` needs for its proxy to hold ``limits``."""
    return {CALLBACK_VARIABLE: CALLBACK, LIMITS_VARIABLE: json.dumps(dataclasses.asdict(limits), sort_keys=True)}


def proxy_middlewares() -> list:
    """Ray's proxy callback: the body limit as Starlette middleware, and tuneport's HTTP protocol for uvicorn."""
    global ProxyProtocol
    from starlette.middleware import Middleware
    from uvicorn.config import HTTP_PROTOCOLS

    from ..gateway.body_limit import BodyLimit
    from ..gateway.connections import protocol_for

    limits = HttpLimits(**json.loads(os.environ.get(LIMITS_VARIABLE) or "{}"))
    ProxyProtocol = protocol_for(limits)
    HTTP_PROTOCOLS["auto"] = PROTOCOL  # Ray's uvicorn.Config names no protocol: "auto" is looked up at its start
    log.info("tuneport's HTTP limits in Ray's proxy: %s", limits)
    return [Middleware(BodyLimit, limits=limits)]
