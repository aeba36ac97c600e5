"""The adapters an admin loaded or unloaded through the ingress, and what each replica last reported.

Replicas report every :data:`REPORT_S` seconds and get the catalog back in the same call: they load what was
registered and unload what was dropped, so an admin load reaches every replica, those started later included.
The ingress waits until every replica heard from lately has applied a change, with each one's result."""

from __future__ import annotations

import asyncio
import time

REPORT_S = 1.0  # how often a replica reports and syncs
LIVE_S = 5.0  # a replica not heard from this long counts as gone


class AdapterCatalog:
    def __init__(self) -> None:
        self.version = 0
        self.registered: dict[str, dict] = {}  # name -> {"path", "pinned", "version"}
        self.unloads: list[tuple[int, str]] = []  # (version, name), the latest 1000
        self.reports: dict[str, dict] = {}  # replica id -> its last report (+ "seen")

    def _bump(self) -> int:
        self.version += 1
        return self.version

    async def register(self, name: str, path: str, pinned: bool) -> int:
        self.registered[name] = {"path": path, "pinned": pinned, "version": self._bump()}
        return self.version

    async def unregister(self, name: str) -> int:
        self.registered.pop(name, None)
        self.unloads = [*self.unloads[-999:], (self._bump(), name)]
        return self.version

    async def report(self, replica_id: str, report: dict) -> dict:
        """Record a replica's state; the catalog it syncs to."""
        self.reports[replica_id] = {**report, "seen": time.monotonic()}
        return {"version": self.version, "registered": self.registered, "unloads": self.unloads}

    async def drop(self, replica_id: str) -> None:
        """A replica shutting down."""
        self.reports.pop(replica_id, None)

    async def live(self) -> dict[str, dict]:
        now = time.monotonic()
        return {rid: r for rid, r in self.reports.items() if now - r["seen"] <= LIVE_S}

    async def wait_applied(self, version: int, timeout_s: float = 30.0) -> dict[str, dict]:
        """Every live replica's report once each has applied ``version`` (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = await self.live()
            if live and all(r.get("applied", 0) >= version for r in live.values()) or time.monotonic() > deadline:
                return live
            await asyncio.sleep(REPORT_S / 4)
