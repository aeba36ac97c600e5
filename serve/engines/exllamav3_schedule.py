"""Which waiting requests join exllamav3's generator: one adapter set at a time (:class:`AdapterTurns`, pure
bookkeeping, no engine; see :mod:`tuneport.serve.engines.exllamav3`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

AdapterSet = tuple[tuple[str, float], ...]  # (name, scale) sorted by name; () is the base


def adapter_set(adapters: dict[str, float]) -> AdapterSet:
    return tuple(sorted(adapters.items()))


@dataclass(eq=False)
class Waiting:
    """What :class:`AdapterTurns` schedules: anything with the adapter set it needs."""

    key: Hashable


@dataclass
class AdapterTurns:
    """Which waiting requests join the generator, one adapter set at a time (pure bookkeeping, no engine).

    ``admit(running)`` with ``running`` sequences in the generator: when it is idle, the oldest waiting request's
    set takes the turn and all its waiting requests join (up to ``max_batch``); while a turn runs, more requests of
    its set join only as long as no other set waits (else the batch drains, then that set goes next)."""

    max_batch: int
    pending: list = field(default_factory=list)
    current: Hashable | None = None
    switches: int = 0

    def add(self, item) -> None:
        self.pending.append(item)

    def admit(self, running: int) -> tuple[Hashable | None, list]:
        if running == 0:
            if not self.pending:
                return self.current, []
            key = self.pending[0].key
        else:
            key = self.current
            if any(p.key != key for p in self.pending):
                return key, []
        take = [p for p in self.pending if p.key == key][: max(0, self.max_batch - running)]
        if take:
            chosen = set(map(id, take))
            self.pending = [p for p in self.pending if id(p) not in chosen]
            self.switches += key != self.current
            self.current = key
        return key, take
