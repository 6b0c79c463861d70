"""Routing decisions as pure functions: no torch, no ray, no clock of their own.

Each takes what it needs (token count, weights, a uniform draw, the current time) so tests can pin
exact expectations, e.g.::

    >>> buckets = (BucketSpec("short", 2048, 60.0), BucketSpec("long", 8192, 300.0))
    >>> pick_bucket(2048, buckets).name, pick_bucket(2049, buckets).name
    ('short', 'long')
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

from app.settings import BucketSpec, VersionSpec


class RoutingError(Exception):
    """A request the router refuses; carries the HTTP status and the field to name."""

    def __init__(self, status: int, field: str | None, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message
        self.retry_after = retry_after


def pick_bucket(num_tokens: int, buckets: Sequence[BucketSpec], forced: str | None = None) -> BucketSpec:
    """The smallest bucket whose ``max_prompt_tokens`` fits ``num_tokens``.

    ``forced`` names a bucket explicitly (the ``sinkserve.pool`` extension); it must exist and fit.
    Prompts beyond the largest bucket are refused with both numbers in the message.
    """
    ordered = sorted(buckets, key=lambda b: b.max_prompt_tokens)
    if not ordered:
        raise RoutingError(503, None, "no pools are configured")
    if forced is not None:
        match = [b for b in ordered if b.name == forced]
        if not match:
            names = ", ".join(b.name for b in ordered)
            raise RoutingError(400, "sinkserve.pool", f"unknown pool {forced!r}; pools are: {names}")
        if num_tokens > match[0].max_prompt_tokens:
            raise RoutingError(
                400,
                "prompt",
                f"prompt has {num_tokens} tokens, more than pool {forced!r} accepts "
                f"({match[0].max_prompt_tokens} tokens)",
            )
        return match[0]
    for b in ordered:
        if num_tokens <= b.max_prompt_tokens:
            return b
    largest = ordered[-1]
    raise RoutingError(
        400,
        "prompt",
        f"prompt has {num_tokens} tokens, more than the largest pool ({largest.name!r}) accepts: "
        f"{largest.max_prompt_tokens} tokens",
    )


def pick_version(versions: Sequence[VersionSpec], u: float) -> VersionSpec:
    """Weighted choice by a uniform draw ``u`` in [0, 1).

    Versions are laid out on [0, total) in configuration order; weight 0 takes no room, so a
    version at weight 0 never gets traffic (rollback = set the canary's weight to 0).

    >>> vs = (VersionSpec("v1", "m", 3.0), VersionSpec("v2", "m", 1.0))
    >>> [pick_version(vs, u).name for u in (0.0, 0.74, 0.75, 0.99)]
    ['v1', 'v1', 'v2', 'v2']
    """
    live = [v for v in versions if v.weight > 0]
    if not live:
        raise RoutingError(503, None, "every model version has weight 0")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    total = sum(v.weight for v in live)
    point = u * total
    acc = 0.0
    for v in live:
        acc += v.weight
        if point < acc:
            return v
    return live[-1]  # float round-off at the top edge


def version_for_bucket(
    bucket: BucketSpec, versions: Sequence[VersionSpec], chosen: VersionSpec, u: float
) -> VersionSpec:
    """Keep ``chosen`` if ``bucket`` serves it; otherwise redo the weighted draw (same ``u``)
    among the versions the bucket does serve (a canary deployed on one bucket only).

    >>> b = BucketSpec("long", 8192, 300.0, versions=("v1",))
    >>> vs = (VersionSpec("v1", "m", 1.0), VersionSpec("v2", "m", 1.0))
    >>> version_for_bucket(b, vs, vs[1], 0.9).name
    'v1'
    """
    if bucket.versions is None or chosen.name in bucket.versions:
        return chosen
    served = [v for v in versions if v.name in bucket.versions]
    if not any(v.weight > 0 for v in served):
        # Every version this bucket serves is at weight 0: still serve rather than refuse.
        return served[0]
    return pick_version(served, u)


def session_draw(session_id: str) -> float:
    """A stable uniform draw for a session, so one conversation stays on one model version."""
    digest = hashlib.sha256(session_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class TokenBucket:
    """Classic token bucket with an injected clock: ``rate`` tokens/s, at most ``burst`` saved.

    >>> tb = TokenBucket(rate=1.0, burst=2, tokens=2.0, updated=0.0)
    >>> [tb.try_acquire(0.0)[0], tb.try_acquire(0.0)[0], tb.try_acquire(0.0)]
    [True, True, (False, 1.0)]
    >>> tb.try_acquire(1.0)
    (True, 0.0)
    """

    rate: float
    burst: int
    tokens: float
    updated: float

    def try_acquire(self, now: float) -> tuple[bool, float]:
        """Take one token if there is one; otherwise return how long until there is."""
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(float(self.burst), self.tokens + elapsed * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True, 0.0
        return False, (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One token bucket per API key (per router replica; routers share no state)."""

    def __init__(self, rate: float | None, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, key: str | None, now: float) -> None:
        """Raise a 429 ``RoutingError`` (with Retry-After) when ``key`` is over its rate."""
        if self.rate is None:
            return
        key = key or "anonymous"
        tb = self._buckets.get(key)
        if tb is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()  # bounded memory beats exactness for a forgotten key
            tb = self._buckets[key] = TokenBucket(self.rate, self.burst, float(self.burst), now)
        ok, wait = tb.try_acquire(now)
        if not ok:
            raise RoutingError(
                429, None, f"rate limit exceeded: {self.rate:g} requests/s per key", retry_after=math.ceil(wait)
            )
