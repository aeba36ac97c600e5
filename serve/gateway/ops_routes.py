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
        gauges = {k: v for k, v in backend.describe().items() if k.endswith("_bytes") and isinstance(v, int)}
        engine = backend.counters()
        gauges.update({k: v for k, v in engine.items() if not k.endswith("_total")})
        return PlainTextResponse(backend.metrics.render(
            backend.pool, gauges, {k: v for k, v in engine.items() if k.endswith("_total")}))

    return router
