"""StatsHub: a tiny deployment that holds the latest snapshot pushed by every replica.

Replicas push (rather than the ingress pulling) because a Serve handle reaches *one* replica of a
deployment; with pushes, one ``/metrics`` scrape or ``/readyz`` probe sees them all. Entries expire
after ``ttl_s`` (the app's ``stats_ttl_s``) so a dead replica stops counting as ready.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve


@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0.05},
    max_ongoing_requests=1000,
    logging_config={"enable_access_log": False},  # pushes every second would drown the log
)
class StatsHub:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, source_id: str, entry: dict[str, Any]) -> None:
        self._entries[source_id] = (time.monotonic(), entry)

    def forget(self, source_id: str) -> None:
        self._entries.pop(source_id, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items() if now - v[0] <= self.ttl_s}
        return {k: v[1] for k, v in self._entries.items()}
