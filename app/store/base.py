"""The store interface: byte values under string keys, expiring atomic counters, FIFO queues.

Every call is synchronous and short; the ingress runs them off its event loop
(:func:`app.store.base.call`). Any backend failure (file corrupt, server unreachable) is raised as
:class:`StoreError` with the reason, so callers handle one type and readiness can report it.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class StoreError(RuntimeError):
    """The store cannot be used; ``str(e)`` says why (shown by ``/readyz``)."""


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
