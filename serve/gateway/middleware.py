"""Pure ASGI middleware (no per-request task as with ``@app.middleware``): the guard (API key, body size)
and the access log (one line per request, and the request metrics)."""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from ..contract import Usage
from ..http import error_response
from ..metrics import Metrics

access_log = logging.getLogger("tuneport.access")


@dataclass
class AccessRecord:
    """What a route learns about a request for its access-log line (``request.state.access``)."""

    model: str | None = None
    generation: bool = False  # a completion or chat request: counted in the token metrics
    usage: Usage = field(default_factory=Usage)


class Guard:
    """API key and body size, checked before any route runs."""

    def __init__(self, app, api_key: str | None, max_body: int) -> None:
        self.app, self.max_body = app, max_body
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            return await error_response(401, "missing or wrong API key", "authentication_error")(scope, receive, send)
        if int(headers.get(b"content-length") or 0) > self.max_body:
            return await error_response(413, f"request body over {self.max_body} bytes")(scope, receive, send)
        return await self.app(scope, receive, send)


class AccessLog:
    """One ``tuneport.access`` INFO line per request once its answer is complete (streams included):
    client, method, path, status, model/adapter, prompt and completion tokens, milliseconds."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord()
        scope.setdefault("state", {})["access"] = record
        start, status, done = time.perf_counter(), 500, False

        def finish() -> None:
            nonlocal done
            if done:
                return
            done = True
            ms = (time.perf_counter() - start) * 1000
            self.metrics.inc("http_requests_total")
            if record.generation:
                self.metrics.inc("requests_total")
                self.metrics.inc("prompt_tokens_total", record.usage.prompt_tokens)
                self.metrics.inc("completion_tokens_total", record.usage.completion_tokens)
                self.metrics.observe(ms / 1000)
            client = scope.get("client") or ("-", 0)
            access_log.info('%s "%s %s" %d model=%s prompt_tokens=%d completion_tokens=%d ms=%.1f', client[0],
                            scope["method"], scope["path"], status, record.model or "-", record.usage.prompt_tokens,
                            record.usage.completion_tokens, ms)

        async def send_and_watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finish()

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            finish()  # an exception or a client gone mid-stream
