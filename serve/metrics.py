"""Prometheus metrics of a gateway: counters and a request-latency histogram, in constant memory."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

from .pool import PoolStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class Metrics:
    counters: Counter = field(default_factory=Counter)
    # observations per bucket (the last one: above every bound), their sum and count
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    latency_count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.bucket_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.latency_sum += seconds
            self.latency_count += 1

    def render(self, pool: PoolStats, adapters_loaded: int, gauges: dict[str, int] | None = None,
               counters: dict[str, int] | None = None, labelled: list[str] | None = None) -> str:
        """Prometheus text; ``pool``: the adapter pool's figures (summed over replicas on Ray); ``gauges`` and
        ``counters``: engine figures (memory bytes, prompt-cache hits) as ``tuneport_<name>``; ``labelled``: lines
        written as they are (per-replica series)."""
        with self.lock:
            c, buckets = {**self.counters, **(counters or {})}, list(self.bucket_counts)
            total, count = self.latency_sum, self.latency_count
        c.update({"adapter_loads_total": pool.loads, "adapter_evictions_total": pool.evictions,
                  "adapter_hits_total": pool.hits, "adapter_misses_total": pool.misses})
        lines = []
        for name, v in sorted(c.items()):
            lines += [f"# TYPE tuneport_{name} counter", f"tuneport_{name} {v}"]
        lines.append("# TYPE tuneport_request_latency_seconds histogram")
        cumulative = 0
        for b, n in zip(LATENCY_BUCKETS, buckets, strict=False):
            cumulative += n
            lines.append(f'tuneport_request_latency_seconds_bucket{{le="{b}"}} {cumulative}')
        lines.append(f'tuneport_request_latency_seconds_bucket{{le="+Inf"}} {count}')
        lines.append(f"tuneport_request_latency_seconds_sum {total}")
        lines.append(f"tuneport_request_latency_seconds_count {count}")
        lines.append(f"tuneport_adapters_loaded {adapters_loaded}")
        for name, v in sorted((gauges or {}).items()):
            lines += [f"# TYPE tuneport_{name} gauge", f"tuneport_{name} {v}"]
        lines += labelled or []
        return "\n".join(lines) + "\n"
