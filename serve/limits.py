"""The limits a client is held to, however it frames its request: one table of flags, defaults and who holds each.

The body limits are held by :class:`~.gateway.body_limit.BodyLimit`, an ASGI middleware: in the gateway under any
server, and in Ray Serve's own HTTP proxy (:mod:`.rayserve.proxy`); the connection limits by the HTTP protocol of
``tuneport serve``'s own server (:mod:`.gateway.connections`), which tuneport's callback also installs in Ray's proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneport.convert.errors import UserError

MIB = 1 << 20


@dataclass(frozen=True)
class HttpLimits:
    """Every limit on what a client sends or holds open; the defaults are ``tuneport serve``'s."""

    max_body_bytes: int = MIB  # a body's bytes, counted as they arrive (Content-Length or chunked): 413 above
    body_timeout_s: float = 60.0  # the whole body must arrive within this (slow or lying clients): 408
    max_header_bytes: int = 32 << 10  # the request line and headers: 400 above (local server)
    header_timeout_s: float = 10.0  # a new connection must send its request headers within this (local server)
    idle_timeout_s: float = 5.0  # after an answer: the next request's headers within this, or closed (local server)
    send_timeout_s: float = 60.0  # a client that reads nothing of its answer this long is disconnected (local server)
    max_connections: int = 1024  # connections held open; idle ones are closed first to make room (local server)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise UserError(f"{LIMIT_FLAGS[name]} must be at least 1", "leave it out for the default")
        for name in ("body_timeout_s", "header_timeout_s", "idle_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{LIMIT_FLAGS[name]} must be above 0 seconds", "leave it out for the default")


LIMIT_FLAGS = {"max_body_bytes": "--max-body-bytes", "body_timeout_s": "--body-timeout",
               "max_header_bytes": "--max-header-bytes", "header_timeout_s": "--header-timeout",
               "idle_timeout_s": "--idle-timeout", "send_timeout_s": "--send-timeout",
               "max_connections": "--max-connections"}
CONNECTION_LIMITS = ("max_header_bytes", "header_timeout_s", "idle_timeout_s", "send_timeout_s", "max_connections")
