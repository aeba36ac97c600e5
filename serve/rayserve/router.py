"""The backend the ingress's gateway answers through: each request goes to the replica deployment, with its
adapter as the multiplexed model id; admin loads and unloads go through the catalog to every replica; health,
listings and /metrics come from the replicas' reports. The gateway itself is the one ``create_app``."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from ray.exceptions import ActorUnavailableError, RayActorError

from tuneport.convert.errors import UserError

from ..backend import Backend, Kind, Usage
from ..errors import ApiError
from ..pool import PoolError, PoolStats, check_name, resolve_inside
from .catalog import REPORT_S

log = logging.getLogger("tuneport.serve.ray")
REPLICA_GONE = (RayActorError, ActorUnavailableError)
RETRIES = 2  # a request whose replica died before answering goes to another one this many times


def _raise(error: dict) -> None:
    raise ApiError(error["message"], error.get("hint", ""), status=error["status"], kind=error.get("kind"))


def _gone(e: Exception) -> ApiError:
    return ApiError(f"the replica serving this request stopped ({type(e).__name__}) and no other one answered",
                    "Ray is replacing it; send the request again", status=503)


class ReplicaRouter(Backend):
    def __init__(self, info: dict, replicas, catalog, allowed_roots: list[Path], startup: list[str],
                 multiplex: bool = True, adapter_dir: Path | None = None) -> None:
        self.engine = info["engine"]
        self.weighted_mixes = info["weighted_mixes"]
        self.default_max_tokens = info["default_max_tokens"]
        super().__init__(info["name"], info["max_adapters"], adapter_dir)  # its pool only answers on_demand()
        self.created = info["created"]
        self.replicas, self.catalog, self.multiplex = replicas, catalog, multiplex
        self.allowed_roots, self.startup = allowed_roots, startup
        self.live: dict[str, dict] = {}  # replica id -> its last report
        self._watch: asyncio.Task | None = None

    async def watch(self) -> None:
        """Keep :attr:`live` fresh (the replicas' reports, every REPORT_S)."""
        while True:
            try:
                self.live = await self.catalog.live.remote()
            except Exception as e:  # noqa: BLE001 - the catalog restarting: keep the last view
                log.warning("catalog unreachable: %s", e)
            await asyncio.sleep(REPORT_S)

    # -- requests -----------------------------------------------------------------------------------
    def _handle(self, body: dict, stream: bool = False):
        model = body.get("model")
        routed = self.multiplex and isinstance(model, str) and model not in ("", self.name) and not body.get("adapters")
        return self.replicas.options(stream=stream, multiplexed_model_id=model if routed else "")

    async def generate(self, kind: Kind, body: dict, usage: Usage) -> dict:
        self.adapters_for(body)  # names and mixes checked here: a bad one is a 400 before any replica
        for attempt in range(RETRIES + 1):
            try:
                result = await self._handle(body).generate.remote(kind, body)
                break
            except REPLICA_GONE as e:
                log.warning("replica gone under a request (attempt %d): %s", attempt + 1, type(e).__name__)
                if attempt == RETRIES:
                    raise _gone(e) from e
        if "error" in result:
            _raise(result["error"])
        usage.prompt_tokens = result["usage"]["prompt_tokens"]
        usage.completion_tokens = result["usage"]["completion_tokens"]
        return result["response"]

    async def stream(self, kind: Kind, body: dict, usage: Usage):
        self.adapters_for(body)
        for attempt in range(RETRIES + 1):
            events = self._handle(body, stream=True).stream.remote(kind, body)
            try:
                item = await events.__anext__()
                break
            except StopAsyncIteration:
                return
            except REPLICA_GONE as e:
                if attempt == RETRIES:
                    raise _gone(e) from e
        if isinstance(item, dict) and "error" in item:
            _raise(item["error"])
        try:
            while True:
                if isinstance(item, dict):
                    usage.prompt_tokens = item["usage"]["prompt_tokens"]
                    usage.completion_tokens = item["usage"]["completion_tokens"]
                else:
                    yield item
                item = await events.__anext__()
        except StopAsyncIteration:
            return
        except REPLICA_GONE as e:  # mid-stream: the status is sent already; the stream ends with an error event
            error = {"message": _gone(e).line(), "type": "upstream_error", "code": 503}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        finally:
            events.cancel()

    def check_model(self, body: dict) -> None:
        """404 before a replica is asked: an adapter no replica holds, none was loaded through the admin API or at
        start-up, and ``--adapter-dir`` does not hold."""
        for name in self.adapters_for(body):
            if name not in self.adapter_names() and self.pool.on_demand(name) is None:
                raise PoolError(f"adapter {name!r} is not loaded", "load it first (POST /v1/adapters)", status=404)

    @classmethod
    def from_options(cls, opts) -> ReplicaRouter:
        raise UserError("the Ray ingress's backend is built by tuneport.serve.rayserve.app", "")

    # -- adapters -----------------------------------------------------------------------------------
    def attach_adapter(self, name: str, path: Path) -> int:  # the replicas' pools load; this pool stays empty
        raise PoolError("adapters load in the replicas", "POST /v1/adapters", status=500)

    def detach_adapter(self, name: str) -> None:
        raise PoolError("adapters unload in the replicas", "DELETE /v1/adapters/NAME", status=500)

    def _loaded(self) -> dict[str, list[dict]]:
        """Each adapter loaded anywhere: its state in every replica that holds it."""
        out: dict[str, list[dict]] = {}
        for rid, report in sorted(self.live.items()):
            for state in report["adapters"]:
                out.setdefault(state["name"], []).append({**state, "replica": rid})
        return out

    def load_adapter(self, name: str, path: str | Path, pinned: bool = False) -> dict:
        """Register ``name`` with the catalog; every replica loads it (at its next sync) and reports. Refused
        (409) when it is loaded already, and with the first replica's error when one cannot load it."""
        check_name(name)
        if name in self.startup or name in self._loaded():
            raise PoolError(f"adapter {name!r} is already loaded", "unload it first", status=409)
        p = resolve_inside(path, self.allowed_roots)
        version = self.catalog.register.remote(name, str(p), pinned).result()
        live = self.catalog.wait_applied.remote(version).result()
        failed = [(rid, r["results"].get(version)) for rid, r in live.items() if r["results"].get(version)]
        if failed:
            self.catalog.unregister.remote(name).result()
            raise PoolError(f"replica {failed[0][0]} could not load adapter {name!r}: {failed[0][1]}",
                            "fix the adapter, then load it again", status=422)
        if not live:
            raise PoolError("no replica is running", "wait for Ray to start one (GET /health)", status=503)
        self.live = live
        return {"name": name, "path": str(p), "pinned": pinned, "replicas": sorted(live)}

    def unload_adapter(self, name: str) -> None:
        check_name(name)
        if name not in self._loaded():
            raise PoolError(f"adapter {name!r} is not loaded", "", status=404)
        version = self.catalog.unregister.remote(name).result()
        live = self.catalog.wait_applied.remote(version).result()
        self.live = live or self.live
        refused = [(rid, r["results"].get(version)) for rid, r in live.items() if r["results"].get(version)]
        if refused:
            raise PoolError(f"replica {refused[0][0]} kept adapter {name!r}: {refused[0][1]}", "", status=409)

    def adapter_names(self) -> list[str]:
        return sorted(set(self._loaded()) | set(self.startup))

    def adapter_states(self) -> dict:
        adapters = []
        for name, states in sorted(self._loaded().items()):
            first = states[0]
            adapters.append({"name": name, "path": first["path"], "pinned": first["pinned"],
                             "in_use": any(s["in_use"] for s in states), "refs": sum(s["refs"] for s in states),
                             "hits": sum(s["hits"] for s in states), "bytes": first["bytes"],
                             "replicas": [s["replica"] for s in states]})
        return {"adapters": adapters, "max_adapters": self.pool.max_adapters, "replicas": len(self.live)}

    # -- state --------------------------------------------------------------------------------------
    def health(self) -> bool:
        return any(r["healthy"] for r in self.live.values())

    def failure(self) -> str | None:
        return None if self.health() else "no replica reports a running engine"

    def describe(self) -> dict:
        return {**super().describe(), "adapters": self.adapter_names(), "replicas": len(self.live),
                "on": "ray", "multiplexed": self.multiplex}

    def metrics_text(self) -> str:
        """The ingress's request figures; the replicas' pool figures and engine counters summed, engine gauges the
        largest replica's; per replica its adapter loads and adapters loaded (``replica`` label)."""
        stats, counters, gauges = PoolStats(), {}, {}
        loads = ["# TYPE tuneport_replica_adapter_loads_total counter"]
        held = ["# TYPE tuneport_replica_adapters_loaded gauge"]
        for rid, r in sorted(self.live.items()):
            for key in ("loads", "evictions", "hits", "misses"):
                setattr(stats, key, getattr(stats, key) + r[key])
            for key, value in r["counters"].items():  # counters summed; gauges: the largest replica's
                if key.endswith("_total"):
                    counters[key] = counters.get(key, 0) + value
                else:
                    gauges[key] = max(gauges.get(key, value), value)
            loads.append(f'tuneport_replica_adapter_loads_total{{replica="{rid}"}} {r["loads"]}')
            held.append(f'tuneport_replica_adapters_loaded{{replica="{rid}"}} {len(r["adapters"])}')
        gauges["replicas"] = len(self.live)
        loaded = sum(len(r["adapters"]) for r in self.live.values())
        return self.metrics.render(stats, loaded, gauges, counters, loads + held)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
