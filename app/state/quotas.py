"""Tenant token quotas, counted in the store so every ingress replica sees the same totals.

Each tenant may have a per-minute and a per-day limit on prompt + completion tokens
(``tenants: {acme: {tokens_per_minute: 1000}}``). Windows are fixed and aligned to the epoch (UTC
minutes, UTC days): one counter per tenant per window, created by its first increment and expiring
after the window.

Admission *reserves* the request's prompt: one atomic step in the store adds it to every window
only if none goes over its limit (:meth:`Store.reserve`), so ten concurrent requests near the limit
cannot all pass a check before any of them is charged. When the request ends it is *reconciled*:
its completion (and any prompt difference) is added to the current windows. A request the pool
refused before doing any work (an error other than a timeout or a client abort, with no token
generated) gets its prompt back; one aborted before its first token keeps it (the prefill ran). So a
tenant overshoots a limit by at most the completions of the requests in flight when it was reached::

    limit 1,000/min   used 940   next prompt 50 -> reserved: 990; finishes with 30 -> used 1,020
                      used 1,020 next prompt 10 -> 429 "... used 1,020 of 1,000 ... resets at 12:01:00Z"

A store that fails: with ``quotas: {fail_closed: true}`` a limited tenant's request is refused (503,
Retry-After) while the store is down; with the default (``false``) it is let through and the log
says so (readiness reports the store's state). Tenants without limits never touch the store.

A reconciliation the store refuses is not dropped: it waits in this replica's *outbox* and is written
before the next quota operation that reaches the store, into the windows it was incurred in (a window
that has ended by then no longer counts against anyone, so its part is dropped, logged). The outbox holds
at most ``MAX_PENDING`` charges; past that the oldest is dropped, logged. A replica that stops with
charges pending loses them (they live in memory)::

    12:00:10  request ends, +40 tokens    store down -> outbox [(acme:minute:720, +40, ends 12:01)]
    12:00:30  next request of any tenant  store back -> outbox written first, then its reservation
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Mapping

from app.errors import APIError
from app.settings import TenantArgs
from app.state.base import Store, StoreError

logger = logging.getLogger("sinkserve.quotas")

# Reconciliations kept while the store is down (each a handful of counter increments).
MAX_PENDING = 10_000


@dataclass(frozen=True)
class Window:
    name: str  # the config field, named in the refusal
    seconds: int


MINUTE, DAY = Window("tokens_per_minute", 60), Window("tokens_per_day", 86400)


@dataclass(frozen=True)
class Reservation:
    """What admission added to a tenant's windows: ``tokens`` in each ``(key, window end)``."""

    tenant: str
    tokens: int
    windows: tuple[tuple[str, float], ...] = ()


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

    def __init__(self, store: Store, limits: Mapping[str, TenantArgs], clock: Callable[[], float] = time.time,
                 fail_closed: bool = False) -> None:
        self.store = store
        self.limits = dict(limits)
        self.clock = clock
        self.fail_closed = fail_closed
        # Charges / refunds the store refused: (tenant, [(key, tokens, window end)]), oldest first.
        self._pending: deque[tuple[str, list[tuple[str, int, float]]]] = deque()
        # Quota operations run on the ingress's planning threads: one writer of the outbox at a time (a
        # flush holds it across its store calls, so two threads never write the same charge twice).
        self._outbox_lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Reconciliations waiting for the store (the outbox's length)."""
        return len(self._pending)

    def _commit(self, tenant: str, incrs: list[tuple[str, int, float]]) -> None:
        """Write ``incrs`` (key, tokens, window end) after any pending ones; on a store error keep them
        in the outbox (raises nothing)."""
        if self._pending and not self._flush():
            self._keep(tenant, incrs)
            return
        now = self.clock()
        live = [(k, n, end - now + 60) for k, n, end in incrs if now < end]
        if not live:
            return
        try:
            self.store.commit(incrs=live)  # every window or none
        except StoreError as e:
            logger.warning("quota change of tenant %s not written yet (kept, retried with the next quota "
                           "operation): %s", tenant, e)
            self._keep(tenant, incrs)

    def _keep(self, tenant: str, incrs: list[tuple[str, int, float]]) -> None:
        with self._outbox_lock:
            self._pending.append((tenant, incrs))
            self._trim()

    def _trim(self) -> None:
        while len(self._pending) > MAX_PENDING:
            old_tenant, old = self._pending.popleft()
            logger.warning("quota outbox full (%d): change of %s tokens for tenant %s lost", MAX_PENDING,
                           "/".join(str(n) for _, n, _ in old), old_tenant)

    def _flush(self) -> bool:
        """Write the outbox, oldest first; False when the store still fails (what is left stays)."""
        with self._outbox_lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        while self._pending:
            tenant, incrs = self._pending[0]
            now = self.clock()
            live = [(k, n, end - now + 60) for k, n, end in incrs if now < end]
            if len(live) < len(incrs):
                logger.warning("quota change of tenant %s dropped for %d ended window(s)", tenant,
                               len(incrs) - len(live))
            if live:
                try:
                    self.store.commit(incrs=live)
                except StoreError:
                    return False
            self._pending.popleft()
        return True

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

    def reserve(self, tenant: str, prompt_tokens: int) -> Reservation:
        """Add ``prompt_tokens`` to each of ``tenant``'s windows atomically, or raise a 429
        ``APIError`` naming the quota, the tokens used and the reset time when that would go over
        one of its limits (nothing is added then). A failing store raises a 503 when ``fail_closed``,
        else lets the request through with nothing reserved."""
        now = self.clock()
        windows = self._windows(tenant)
        keys = [window_key(tenant, w, now) for w, _ in windows]
        if self._pending:
            self._flush()  # earlier charges first: they count against this reservation
        try:
            ok, values = self.store.reserve([(k, n, end - now + 60) for (k, end), (_, n) in zip(keys, windows)],
                                            prompt_tokens)
        except StoreError as e:
            if self.fail_closed:
                logger.warning("quota of tenant %s not checked, request refused (quotas.fail_closed): %s", tenant, e)
                raise APIError(503, f"tenant {tenant!r} has a token quota and the quota store is unavailable; retry "
                                    "later", type="server_error", retry_after=5) from None
            logger.warning("quota of tenant %s not checked, request let through: %s", tenant, e)
            return Reservation(tenant, 0)
        if ok:
            return Reservation(tenant, prompt_tokens, tuple(keys))
        for (w, limit), (_, end), used in zip(windows, keys, values):
            if used + prompt_tokens > limit:
                at = datetime.fromtimestamp(end, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                wait = max(1, math.ceil(end - now))
                raise APIError(429, f"tenant {tenant!r} is over its {w.name} quota: {used} of {limit} "
                                    f"tokens used, this request's prompt needs {prompt_tokens} more; the quota "
                                    f"resets at {at} (in {wait} s)", w.name, "quota_exceeded", retry_after=wait)
        raise AssertionError("the store refused a reservation no window explains")

    def reconcile(self, res: Reservation, tokens: int) -> None:
        """The request ended having used ``tokens`` (prompt + completion): add what admission did
        not reserve to the current windows, or give back what it reserved too much to the windows
        it was reserved in while they last. A failing store keeps the difference in the outbox."""
        diff = tokens - res.tokens
        if diff > 0:
            self.charge(res.tenant, diff)
            return
        if diff == 0:
            return
        self._commit(res.tenant, [(key, diff, end) for key, end in res.windows])

    def charges(self, tenant: str, tokens: int) -> list[tuple[str, int, float]]:
        """The counter increments that add ``tokens`` to ``tenant``'s current windows (for a
        :meth:`Store.commit` that charges in the same step as it records a result)."""
        now = self.clock()
        # Each counter outlives its window a little.
        return [(key, n, end - now + 60) for key, n, end in self._window_incrs(tenant, tokens, now)]

    def _window_incrs(self, tenant: str, tokens: int, now: float) -> list[tuple[str, int, float]]:
        """``(key, tokens, window end)`` for each of the tenant's current windows (none for ``tokens <= 0``)."""
        if tokens <= 0:
            return []
        return [(key, tokens, end) for key, end in (window_key(tenant, w, now) for w, _ in self._windows(tenant))]

    def charge(self, tenant: str, tokens: int) -> None:
        """Add ``tokens`` to each of the tenant's current windows (a failing store: kept in the outbox,
        written with the next quota operation that reaches the store)."""
        incrs = self._window_incrs(tenant, tokens, self.clock())
        if incrs:
            self._commit(tenant, incrs)
