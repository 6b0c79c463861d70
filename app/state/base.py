"""The store interface: byte values under string keys, expiring atomic counters, FIFO queues.

Every call is synchronous and short; the ingress runs them off its event loop
(:func:`app.state.base.call`). Any backend failure (file corrupt, server unreachable) is raised as
:class:`StoreError` with the reason, so callers handle one type and readiness can report it.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol, Sequence, TypeVar

T = TypeVar("T")

Put = tuple[str, bytes, "float | None"]  # key, value, ttl_s
Incr = tuple[str, int, float]  # counter key, amount, ttl_s (as in Store.incr)
Limit = tuple[str, int, float]  # counter key, limit, ttl_s


class StoreError(RuntimeError):
    """The store cannot be used. ``str(e)`` says why and where (credentials masked: for the log);
    ``public`` says why without saying where (``/readyz`` shows it to anyone)."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public or message


class Store(Protocol):
    """What sessions, quotas and jobs need from a store."""

    kind: str  # "sqlite" | "redis"

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None (absent or expired)."""

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Set ``key`` (replacing any value); it expires after ``ttl_s`` when given."""

    def put_if_absent(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        """Set ``key`` only when it holds nothing (or expired); True when this call set it."""

    def delete(self, key: str) -> bool:
        """Remove ``key``; True when something was removed."""

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        """Add ``amount`` to the counter ``key`` atomically and return the new value. A counter that
        does not exist (or expired) starts at 0 and expires ``ttl_s`` after this first increment."""

    def counter(self, key: str) -> int:
        """The counter's value (0 when absent or expired)."""

    def delete_if(self, key: str, value: bytes) -> bool:
        """Remove ``key`` only while it holds ``value`` (an owner-checked unlock); True when removed."""

    def reserve(self, limits: Sequence[Limit], amount: int) -> tuple[bool, list[int]]:
        """Add ``amount`` to every counter of ``limits`` in one atomic step, only if none would pass
        its limit: ``(True, values after)``; else nothing changes and ``(False, values now)``.
        Concurrent reservations never overshoot a limit together (no check-then-charge race)."""

    def commit(self, puts: Sequence[Put] = (), incrs: Sequence[Incr] = (), deletes: Sequence[str] = (),
               pushes: Sequence[tuple[str, bytes]] = (), expect: tuple[str, bytes | None] | None = None) -> bool:
        """Apply every write in one atomic step. With ``expect=(key, value)`` only while ``key``
        holds ``value`` (None: absent); False (nothing written) when it does not -- a compare-and-set
        that job state changes use so two writers never both win."""

    def move(self, src: str, dst: str) -> bytes | None:
        """Move the oldest item of queue ``src`` to the end of queue ``dst`` atomically and return it
        (None when ``src`` is empty): an item is always on one of the two queues."""

    def purge_expired(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` expired values and counters; the number deleted (Redis expires
        keys itself: 0)."""

    def push(self, queue: str, item: bytes) -> None:
        """Append ``item`` to the FIFO ``queue``."""

    def pop(self, queue: str) -> bytes | None:
        """Remove and return the oldest item of ``queue`` (None when empty); atomic across processes."""

    def ping(self) -> None:
        """Raise ``StoreError`` with the reason when the store cannot be read and written."""

    def close(self) -> None:
        """Release connections."""


async def call(fn: Callable[..., T], *args: object) -> T:
    """Run a store call in a worker thread, so a slow disk or network never stalls the event loop."""
    return await asyncio.to_thread(fn, *args)


async def purge_forever(store: Store, interval_s: float = 60.0, batch: int = 1000) -> None:
    """Delete the store's expired rows every ``interval_s``, a bounded batch at a time (so one pass
    never holds the SQLite write lock long); a failing store is logged and tried again later."""
    import logging

    log = logging.getLogger("sinkserve.store")
    while True:
        try:
            while await call(store.purge_expired, batch) >= batch:
                await asyncio.sleep(0)  # more to do: the next batch at once, other work between
        except StoreError as e:
            log.warning("purging expired rows failed: %s", e)
        await asyncio.sleep(interval_s)
