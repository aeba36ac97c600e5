"""Pure ASGI middleware (no per-request task as with ``@app.middleware``): the key guard, the requests in flight per
key and the access log (one line per request, and the request metrics). The body's limits are
:mod:`.body_limit`'s."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field

from ..backend import Usage
from ..http import error_response
from ..metrics import Metrics

access_log = logging.getLogger("tuneport.access")


@dataclass
class AccessRecord:
    """What a route learns about a request for its access-log line (``request.state.access``)."""

    model: str | None = None
    generation: bool = False  # a completion or chat request: counted in the token metrics
    usage: Usage = field(default_factory=Usage)


ADMIN_PREFIX = "/v1/adapters"  # the admin API: GET/POST /v1/adapters, DELETE /v1/adapters/{name}
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # counted per key


def _digest(value: bytes) -> bytes:
    """Keys are compared as SHA-256 digests: equal lengths, so ``compare_digest`` leaks not even the length."""
    return hashlib.sha256(value).digest()


class KeyGuard:
    """The first refusal: the key (401/403), before anything of the request is read.

    ``api_key`` guards every route; ``admin_key`` (when given) alone opens the admin API and opens the other
    routes too; without it the API key guards the admin API as well. Each key is compared in constant time,
    and both are always compared, so the time taken tells nothing of which one matched. Which key a request holds
    ("admin", "inference" or "none") is left in ``scope["state"]["key"]`` for :class:`InFlightLimit`."""

    def __init__(self, app, api_key: str | None, admin_key: str | None = None) -> None:
        self.app = app
        self.inference = _digest(f"Bearer {api_key}".encode()) if api_key else None
        self.admin = _digest(f"Bearer {admin_key}".encode()) if admin_key else None

    def _refusal(self, path: str, authorization: bytes) -> tuple[str, tuple[int, str] | None]:
        """(which key the request holds, the refusal if any)."""
        presented = _digest(authorization)
        inference = self.inference is not None and hmac.compare_digest(presented, self.inference)
        admin = self.admin is not None and hmac.compare_digest(presented, self.admin)
        who = "admin" if admin else "inference" if inference else "none"
        normal = "/" + "/".join(part for part in path.split("/") if part)  # "//v1//adapters" routes nowhere
        if self.admin is not None and (normal == ADMIN_PREFIX or normal.startswith(ADMIN_PREFIX + "/")):
            if admin:
                return who, None
            if inference:
                return who, (403, "the admin API needs the admin key (--admin-key-file), not the API key")
            return who, (401, "missing or wrong admin key")
        if self.inference is not None and not (inference or admin):
            return who, (401, "missing or wrong API key")
        return who, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        who, refusal = self._refusal(scope["path"], authorization)
        if refusal is not None:
            status, message = refusal
            kind = "authentication_error" if status == 401 else "permission_error"
            return await error_response(status, message, kind)(scope, receive, send)
        scope.setdefault("state", {})["key"] = who
        return await self.app(scope, receive, send)


class InFlightLimit:
    """With ``max_concurrent_per_key`` a key (or, without keys, all clients together) may have that many completion
    and chat requests in flight (a stream until its last event); one more answers 429 with ``Retry-After``."""

    def __init__(self, app, max_concurrent_per_key: int | None = None) -> None:
        self.app, self.max_concurrent = app, max_concurrent_per_key
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_concurrent is None or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        who = scope.get("state", {}).get("key", "none")
        if self.in_flight.get(who, 0) >= self.max_concurrent:
            busy = error_response(429, f"this key has {self.max_concurrent} requests in flight, the most "
                                  "--max-concurrent-per-key allows", "rate_limit_error")
            busy.headers["Retry-After"] = "1"
            return await busy(scope, receive, send)
        self.in_flight[who] = self.in_flight.get(who, 0) + 1  # one event loop: no lock needed
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight[who] -= 1


class AccessLog:
    """One ``tuneport.access`` INFO line per request once its answer is complete (streams included):
    client, method, path, status, model/adapter, prompt and completion tokens, milliseconds. A request left before
    any answer (a client gone mid-body) is logged 499, as nginx does."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord()
        scope.setdefault("state", {})["access"] = record
        start, status, done, started = time.perf_counter(), 500, False, False

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
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finish()

        try:
            await self.app(scope, receive, send_and_watch)
            if not started:
                status = 499  # no answer: the client went away first (nginx's "client closed request")
        finally:
            finish()  # an exception (500) or a client gone mid-stream
