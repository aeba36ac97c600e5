"""Operations: health (with what is served) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from ..backend import Backend
from ..http import error_response


def ops_router(backend: Backend) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not backend.health():
            return error_response(503, "the engine is not running; see the server log", "engine_down")
        info = backend.describe()
        return {"status": "ok", "engine": info["engine"], "model": info["model"], "adapters": len(info["adapters"])}

    @router.get("/metrics")
    async def prometheus():
        return PlainTextResponse(backend.metrics_text())

    return router
