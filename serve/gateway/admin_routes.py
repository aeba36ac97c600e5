"""Adapter administration: list, load (from an allowed path) and unload."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from ..backend import Backend
from ..errors import ApiError


def admin_router(backend: Backend) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/adapters")
    async def adapters():
        return backend.adapter_states()

    @router.post("/v1/adapters", status_code=201)
    async def load(body: dict):
        if not isinstance(body.get("name"), str) or not isinstance(body.get("path"), str):
            raise ApiError("body needs 'name' and 'path' strings")
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise ApiError("'pinned' must be true or false")
        return await run_in_threadpool(backend.load_adapter, body["name"], body["path"], pinned)

    @router.delete("/v1/adapters/{name}")
    async def unload(name: str):
        await run_in_threadpool(backend.unload_adapter, name)
        return {"name": name, "unloaded": True}

    return router
