"""Planning off the ingress's event loop: parsing a body, tokenizing, the chat template, BM25 over
passages and JSON-schema conversion run on a small thread pool, so ``/healthz``, streaming and every
other request's bytes keep flowing while one request is planned. Tokenizers (Rust) and grammar code
release the GIL; pure-Python work shares it with the loop at the interpreter's switch interval instead
of holding the loop for its whole length.

Bounded: ``threads`` plans run at once and at most ``max_waiting`` more wait; beyond that a request is
refused at once with 503 and ``Retry-After`` (the replica is saturated; another may not be).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from app.errors import APIError

T = TypeVar("T")


class PlanPool:
    """A bounded thread pool for the ingress's CPU work (see the module docstring)."""

    def __init__(self, threads: int = 2, max_waiting: int = 64) -> None:
        if threads < 1 or max_waiting < 0:
            raise ValueError(f"threads must be >= 1 and max_waiting >= 0, got {threads}, {max_waiting}")
        self.threads = threads
        self.max_waiting = max_waiting
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ingress-plan")
        self._admitted = 0  # running + waiting

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the pool; its exception (an ``APIError``) is raised here."""
        if self._admitted >= self.threads + self.max_waiting:
            raise APIError(503, f"ingress is busy planning {self._admitted} requests; retry", type="overloaded",
                           retry_after=1)
        self._admitted += 1
        try:
            ctx = contextvars.copy_context()
            call = functools.partial(ctx.run, fn, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            self._admitted -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
