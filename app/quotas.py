"""Tenant token quotas, counted in the store so every ingress replica sees the same totals.

Each tenant may have a per-minute and a per-day limit on prompt + completion tokens
(``tenants: {acme: {tokens_per_minute: 1000}}``). Windows are fixed and aligned to the epoch (UTC
minutes, UTC days): one counter per tenant per window, created by its first increment and expiring
after the window. A request is refused (429) when what the tenant used in the window plus the
request's prompt is over the limit; once it finishes its prompt + completion tokens are added.
So a tenant overshoots a limit by at most the completions of the requests in flight when it was
reached (one request's, for a client that waits for each answer)::

    limit 1,000/min   used 940   next prompt 50 -> 990 <= 1,000: served, finishes with 30 -> used 1,020
                      used 1,020 next prompt 10 -> 429 "... used 1,020 of 1,000 ... resets at 12:01:00Z"

A store that fails does not stop traffic: the check lets requests through and logs why (readiness
reports the store's state).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Mapping

from app.errors import APIError
from app.settings import TenantLimits
from app.store.base import Store, StoreError

logger = logging.getLogger("sinkserve.quotas")


@dataclass(frozen=True)
class Window:
    name: str  # the config field, named in the refusal
    seconds: int


MINUTE, DAY = Window("tokens_per_minute", 60), Window("tokens_per_day", 86400)


@dataclass(frozen=True)
class Usage:
    window: Window
    used: int
    limit: int
    resets_at: float  # epoch seconds


def window_key(tenant: str, window: Window, now: float) -> tuple[str, float]:
    """The counter key of ``tenant``'s current ``window`` and when that window ends.

    >>> window_key("acme", MINUTE, 125.0)
    ('quota:acme:tokens_per_minute:2', 180.0)
    """
    idx = int(now // window.seconds)
    return f"quota:{tenant}:{window.name}:{idx}", float((idx + 1) * window.seconds)


class Quotas:
    """Checks and charges tenants' token quotas in ``store``."""

    def __init__(self, store: Store, limits: Mapping[str, TenantLimits], clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.limits = dict(limits)
        self.clock = clock

    def limited(self, tenant: str) -> bool:
        """Whether ``tenant`` has any quota (callers skip the store entirely when not)."""
        return bool(self._windows(tenant))

    def _windows(self, tenant: str) -> list[tuple[Window, int]]:
        lim = self.limits.get(tenant)
        if lim is None:
            return []
        return [(w, n) for w, n in ((MINUTE, lim.tokens_per_minute), (DAY, lim.tokens_per_day)) if n is not None]

    def usage(self, tenant: str) -> list[Usage]:
        """The tenant's current use of each limited window."""
        now = self.clock()
        out = []
        for w, limit in self._windows(tenant):
            key, end = window_key(tenant, w, now)
            out.append(Usage(w, self.store.counter(key), limit, end))
        return out

    def check(self, tenant: str, prompt_tokens: int) -> None:
        """Raise a 429 ``APIError`` naming the quota, the tokens used and the reset time when
        ``prompt_tokens`` more would go over one of ``tenant``'s limits."""
        try:
            usages = self.usage(tenant)
        except StoreError as e:
            logger.warning("quota check for tenant %s skipped: %s", tenant, e)
            return
        now = self.clock()
        for u in usages:
            if u.used + prompt_tokens > u.limit:
                at = datetime.fromtimestamp(u.resets_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                wait = max(1, math.ceil(u.resets_at - now))
                raise APIError(429, f"tenant {tenant!r} is over its {u.window.name} quota: {u.used} of {u.limit} "
                                    f"tokens used, this request's prompt needs {prompt_tokens} more; the quota "
                                    f"resets at {at} (in {wait} s)", u.window.name, "quota_exceeded", retry_after=wait)

    def charge(self, tenant: str, tokens: int) -> None:
        """Add a finished request's prompt + completion tokens to each of the tenant's windows."""
        if tokens <= 0:
            return
        now = self.clock()
        try:
            for w, _ in self._windows(tenant):
                key, end = window_key(tenant, w, now)
                self.store.incr(key, tokens, end - now + 60)  # outlives its window a little
        except StoreError as e:
            logger.warning("quota charge of %d tokens for tenant %s lost: %s", tokens, tenant, e)
