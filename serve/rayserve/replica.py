"""One replica: an engine and its adapter pool (the existing backend contract), answering what the ingress
forwards. A request's adapter is its Ray Serve multiplexed model id, so Ray routes it to a replica that holds the
adapter; the loader loads it through the pool. Admin loads and unloads arrive through the catalog."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from ray import serve
from starlette.concurrency import run_in_threadpool

from tuneport.convert.errors import UserError

from ..backend import Backend, Kind, Usage
from ..errors import ApiError
from ..launch import start_backend
from ..options import ServeOptions
from ..pool import AlreadyLoaded, PoolError
from .catalog import REPORT_S
from .config import replica_options

log = logging.getLogger("tuneport.serve.ray")


def error_payload(e: Exception) -> dict:
    """An engine's refusal as data that crosses the Ray boundary; the ingress raises it again as an ApiError."""
    if isinstance(e, ApiError):
        return {"status": e.status, "message": e.message, "hint": e.hint, "kind": e.kind}
    assert isinstance(e, UserError)
    return {"status": 400, "message": e.message, "hint": e.hint, "kind": "invalid_request_error"}


class AdapterLease:
    """What the multiplexed loader returns: Ray's LRU calls ``__del__`` when it drops the adapter from this
    replica, and the pool unloads it then (unless it is pinned or in use: the pool's own LRU frees it later)."""

    def __init__(self, backend: Backend, name: str) -> None:
        self.backend, self.name = backend, name

    def __del__(self) -> None:
        entry = next((e for e in self.backend.pool.states() if e["name"] == self.name), None)
        if entry is not None and not entry["pinned"] and not entry["in_use"]:
            with contextlib.suppress(PoolError):
                self.backend.pool.remove(self.name)


class ReplicaBase:
    """The replica deployment's class; :func:`replica_class` adds the multiplexed loader with its capacity."""

    async def __init__(self, options: dict, catalog) -> None:
        self.options = ServeOptions(**options)
        local = replica_options(self.options)
        if local.engine == "llamacpp" and local.threads is None:  # the CPUs Ray reserved, not the machine's
            local.threads = max(1, int(self.options.cpus_per_replica))
        # on this thread, which lives as long as the replica: an engine's child process (vLLM) dies with the thread
        # that started it (PR_SET_PDEATHSIG), and a worker thread of a pool may end at any time
        self.backend: Backend = start_backend(local)
        self.catalog = catalog
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.applied = 0  # the catalog version this replica has applied
        self.registered: dict[str, dict] = {}
        self.results: dict[int, str | None] = {}  # catalog version -> why applying it failed (None: it did not)
        self._stopping = False
        await self._sync()
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_forever())

    # -- adapters ---------------------------------------------------------------------------------
    async def _load(self, name: str) -> AdapterLease:
        """Make ``name`` loaded in this replica's pool: the admin-registered path, a start-up adapter, or
        ``--adapter-dir``/NAME (the pool's on-demand load)."""
        pool = self.backend.pool
        if name in pool:
            return AdapterLease(self.backend, name)
        known = self.registered.get(name)
        if known is not None:
            path, pinned = Path(known["path"]), known["pinned"]
        elif name in self.options.adapters:
            from tuneport.convert.adapter import resolve_adapter_path

            path, pinned = resolve_adapter_path(self.options.adapters[name]), self.options.pin
        else:
            def on_demand() -> None:
                with pool.use(name):
                    pass
            await run_in_threadpool(on_demand)
            return AdapterLease(self.backend, name)
        with contextlib.suppress(AlreadyLoaded):
            await run_in_threadpool(pool.add, name, path, pinned, True)
        return AdapterLease(self.backend, name)

    async def _load_requested(self) -> None:
        """Load the request's multiplexed adapter (Ray's LRU and the pool's)."""
        model = serve.get_multiplexed_model_id()
        if model:
            await self.adapter(model)  # the multiplexed loader, added by replica_class
            if model not in self.backend.pool:  # Ray still lists it, but the pool's own LRU evicted it
                await self._load(model)

    # -- answering --------------------------------------------------------------------------------
    async def generate(self, kind: Kind, body: dict) -> dict:
        usage = Usage()
        try:
            await self._load_requested()
            response = await self.backend.generate(kind, body, usage)
        except (ApiError, UserError) as e:
            return {"error": error_payload(e)}
        return {"response": response, "usage": usage.as_dict()}

    async def stream(self, kind: Kind, body: dict):
        """The engine's server-sent events; a refusal as ``{"error": ...}`` before any event, and the usage last."""
        usage = Usage()
        try:
            await self._load_requested()
            events = self.backend.stream(kind, body, usage)
            first = await anext(events)
        except StopAsyncIteration:
            yield {"usage": usage.as_dict()}
            return
        except (ApiError, UserError) as e:
            yield {"error": error_payload(e)}
            return
        try:
            yield first
            async for chunk in events:
                yield chunk
        finally:
            await events.aclose()
        yield {"usage": usage.as_dict()}

    async def describe(self) -> dict:
        """What the ingress's router takes from the engine."""
        return {"name": self.backend.name, "engine": self.backend.engine, "created": self.backend.created,
                "weighted_mixes": self.backend.weighted_mixes, "default_max_tokens": self.backend.default_max_tokens,
                "max_adapters": self.backend.pool.max_adapters}

    # -- catalog ----------------------------------------------------------------------------------
    def _report(self) -> dict:
        pool = self.backend.pool
        stats = pool.stats
        return {"applied": self.applied, "healthy": self.backend.health(), "adapters": pool.states(),
                "loads": stats.loads, "evictions": stats.evictions, "hits": stats.hits, "misses": stats.misses,
                "counters": self.backend.counters(), "results": dict(self.results)}

    async def _sync(self) -> None:
        """Report, then apply what the catalog changed since (loads of registered adapters, unloads)."""
        catalog = await self.catalog.report.remote(self.replica_id, self._report())
        self.registered = catalog["registered"]
        pool = self.backend.pool
        for version, name in catalog["unloads"]:
            if version <= self.applied:
                continue
            why = None
            if name in pool and name not in self.registered:
                try:
                    await run_in_threadpool(pool.remove, name)
                except PoolError as e:  # in use: refused, as on one server (409)
                    why = e.line()
            self.results[version] = why
        for name, entry in sorted(self.registered.items(), key=lambda kv: kv[1]["version"]):
            if entry["version"] <= self.applied:
                continue
            try:
                if name in pool:
                    await run_in_threadpool(pool.remove, name)  # registered again: the new path replaces it
                await run_in_threadpool(pool.add, name, Path(entry["path"]), entry["pinned"], True)
                self.results[entry["version"]] = None
            except (ApiError, UserError) as e:
                self.results[entry["version"]] = e.line()
        self.applied = catalog["version"]
        self.results = {v: r for v, r in self.results.items() if v > self.applied - 100}

    async def _sync_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(REPORT_S)
            try:
                await self._sync()
            except Exception as e:  # noqa: BLE001 - the catalog restarting: the next sync catches up
                log.warning("replica %s: catalog sync failed: %s", self.replica_id, e)

    # -- Ray Serve hooks --------------------------------------------------------------------------
    def check_health(self) -> None:
        """Ray Serve's health check: the engine's own ``failure()``; Ray replaces a replica that fails it."""
        why = self.backend.failure()
        if why is not None:
            raise RuntimeError(f"the {self.backend.engine} engine stopped: {why}")

    async def __del__(self) -> None:
        """Ray Serve's shutdown (after in-flight requests finished): leave the catalog, stop the engine. The catalog
        may be gone first (the whole application deleted): not waited for."""
        self._stopping = True
        self._sync_task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_awaited(self.catalog.drop.remote(self.replica_id)), 1.0)
        await run_in_threadpool(self.backend.close)


async def _awaited(response):
    return await response


def replica_class(max_adapters: int) -> type:
    """The replica class with its multiplexed loader: Ray keeps ``max_adapters`` adapters per replica (the pool's
    capacity) and routes each request to a replica that reported its adapter."""

    class AdapterReplica(ReplicaBase):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def adapter(self, name: str) -> AdapterLease:
            return await self._load(name)

    return AdapterReplica
