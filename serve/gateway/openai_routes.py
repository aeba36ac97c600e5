"""The OpenAI routes: models, completions and chat completions (streamed as server-sent events)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..backend import Backend, Kind
from ..errors import ApiError
from ..openai_fields import check_fields
from .middleware import AccessRecord


def openai_router(backend: Backend, max_tokens_limit: int | None = None) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models():
        base = {"object": "model", "created": backend.created, "owned_by": "tuneport"}
        data = [{"id": backend.name, **base}]
        data += [{"id": n, **base, "parent": backend.name} for n in backend.adapter_names()]
        return {"object": "list", "data": data}

    @router.post("/v1/completions")
    async def completions(request: Request, body: dict):
        return await answer(backend, request, "completions", body, max_tokens_limit)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict):
        return await answer(backend, request, "chat", body, max_tokens_limit)

    return router


async def answer(backend: Backend, request: Request, kind: Kind, body: dict, max_tokens_limit: int | None = None):
    record: AccessRecord = getattr(request.state, "access", None) or AccessRecord()
    record.model, record.generation = str(body.get("model") or backend.name), True
    backend.check_model(body)  # an unknown model is a 404 before any field is looked at
    if max_tokens_limit is not None:
        cap_max_tokens(kind, body, max_tokens_limit, backend.default_max_tokens)
    check_fields(kind, body, backend.engine)  # honoured or refused, never dropped
    if not body.get("stream"):
        return JSONResponse(await backend.generate(kind, body, record.usage))
    events = backend.stream(kind, body, record.usage)
    try:
        first = await anext(events)  # a refusal (unknown adapter, bad request, engine error) is an HTTP error
    except StopAsyncIteration:
        first = b""
    return ClosingStreamingResponse(_then(first, events), media_type="text/event-stream")


def cap_max_tokens(kind: Kind, body: dict, limit: int, default: int | None) -> None:
    """Refuse (400) a ``max_tokens`` (or chat's ``max_completion_tokens``) over ``limit``; a request that names
    none gets the engine's ``default``, or ``limit`` where that default is larger or unbounded."""
    fields = ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",)
    named = False
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        named = True
        if isinstance(value, int | float) and not isinstance(value, bool) and value > limit:
            raise ApiError(f"'{name}' is {value}, over this server's limit of {limit} (--max-tokens-limit)",
                           f"ask for at most {limit} tokens")
    if not named and (default is None or default > limit):
        body["max_tokens"] = limit


async def _then(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """Closes its event generator when the response ends in any way, a client gone mid-stream included
    (Starlette then cancels the response and would leave the generator to the garbage collector): the
    backend's stream releases the adapters it holds at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
