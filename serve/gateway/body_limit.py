"""The request body, bounded in size and time however it is framed: a pure ASGI middleware, so the same limit
holds in ``tuneport serve``'s gateway and in Ray Serve's own HTTP proxy (:mod:`tuneport.serve.rayserve.proxy`)."""

from __future__ import annotations

import anyio

from ..http import error_response
from ..limits import HttpLimits
from ..metrics import Metrics


class BodyLimit:
    """Reads each request's body whole before the app runs, counting bytes as they arrive whatever the framing
    (Content-Length or chunked): 413 on a declared length over ``limits.max_body_bytes`` before a byte is read, or
    the moment the bytes received pass it; 408 when the body has not all arrived within ``limits.body_timeout_s``
    (a slow client, or a Content-Length longer than what it sends). The app sees the body only once it is complete
    and within limits, as one message; nothing is answered to a client that went away mid-body."""

    def __init__(self, app, limits: HttpLimits, metrics: Metrics | None = None) -> None:
        self.app, self.limits, self.metrics = app, limits, metrics or Metrics()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"").strip()
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            return await self._refuse(413, scope, receive, send)
        body = await self._read(receive)
        if body is None:
            return  # the client is gone: nobody to answer
        if isinstance(body, int):
            return await self._refuse(body, scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered, body
            if delivered:
                return await receive()  # after the body: the client's disconnect, when it comes
            message, delivered, body = {"type": "http.request", "body": body, "more_body": False}, True, b""
            return message

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | int | None:
        """The whole body; or the status refusing it (413 over the size, 408 over the time); None on disconnect."""
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limits.max_body_bytes:
                    return 413
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        return 408

    async def _refuse(self, status: int, scope, receive, send) -> None:
        limits = self.limits
        if status == 413:
            self.metrics.inc("refused_body_too_large_total")
            response = error_response(413, f"the request body is over this server's limit of {limits.max_body_bytes} "
                                      "bytes (--max-body-bytes)")
        else:
            self.metrics.inc("refused_body_timeout_total")
            response = error_response(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                                      "(--body-timeout)")
            response.headers["Connection"] = "close"  # the rest of a body that slow is not worth waiting for
        await response(scope, receive, send)
