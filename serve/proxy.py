"""Forwarding OpenAI requests to an engine that speaks OpenAI itself (vLLM), holding the adapter in the
pool for the whole request: loaded on demand, never evicted while the answer is being produced."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .http import error_message, error_response
from .pool import PoolError, check_name


class Upstream:
    """An async HTTP client to the engine, made in the event loop that uses it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # below uvicorn's 5 s keep-alive timeout on the vLLM side: never reuse a connection it is closing
            limits = httpx.Limits(max_connections=512, max_keepalive_connections=128, keepalive_expiry=2.0)
            self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10), limits=limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _upstream_error(r: httpx.Response) -> JSONResponse:
    """vLLM's error with its message; its 5xx become 502 (the gateway itself is fine)."""
    status = r.status_code if r.status_code < 500 else 502
    return error_response(status, f"vLLM: {error_message(r)}",
                          "upstream_error" if status == 502 else "invalid_request_error")


async def forward(service, upstream: Upstream, path: str, body: dict):
    """POST ``body`` to the engine's ``path`` for the adapter ``body['model']`` names."""
    model = body.get("model") or service.name
    if body.get("adapters"):
        raise PoolError("weighted adapter mixes ('adapters') are served by the llama.cpp engine only",
                        "pick one adapter with model=NAME", status=400)
    metrics = service.metrics
    metrics.inc("requests_total")
    start = time.perf_counter()
    stack = contextlib.ExitStack()
    if model != service.name:
        entry = service.pool.try_hold(check_name(model))  # the common case: loaded, no thread hop
        if entry is not None:
            stack.callback(service.pool.release, entry)
        else:  # load on demand (blocking work) in a worker thread
            await run_in_threadpool(stack.enter_context, service.pool.use(model))
    target = service.upstream_model(model)
    sent = {**body, "model": target}
    try:
        if body.get("stream"):
            req = upstream.client.build_request("POST", path, json=sent)
            r = await upstream.client.send(req, stream=True)
            if r.status_code != 200:
                await r.aread()
                await r.aclose()
                stack.close()
                return _upstream_error(r)
            return StreamingResponse(_relay(r, stack, target, model, metrics, start), media_type="text/event-stream")
        r = await upstream.client.post(path, json=sent)
    except httpx.HTTPError as e:
        stack.close()
        return error_response(502, f"vLLM is not reachable ({type(e).__name__}); see the server log", "upstream_error")
    except BaseException:
        stack.close()
        raise
    stack.close()
    if r.status_code != 200:
        return _upstream_error(r)
    content = r.content
    if target != model:  # vLLM names the model it ran; give the client the name it asked for
        content = content.replace(f'"model":{json.dumps(target)}'.encode(), f'"model":{json.dumps(model)}'.encode(), 1)
    usage = r.json().get("usage") or {}
    metrics.inc("completion_tokens_total", int(usage.get("completion_tokens") or 0))
    metrics.inc("prompt_tokens_total", int(usage.get("prompt_tokens") or 0))
    metrics.observe(time.perf_counter() - start)
    return Response(content, media_type="application/json")


async def _relay(r: httpx.Response, stack: contextlib.ExitStack, target: str, model: str, metrics,
                 start: float) -> AsyncIterator[bytes]:
    """SSE lines as vLLM sends them, with the served model name put back; releases the adapter at the end."""
    old, new = f'"model":{json.dumps(target)}', f'"model":{json.dumps(model)}'
    try:
        async for line in r.aiter_lines():
            if target != model and line.startswith("data: "):
                line = line.replace(old, new, 1)
            yield (line + "\n").encode()
    finally:
        await r.aclose()
        stack.close()
        metrics.observe(time.perf_counter() - start)
