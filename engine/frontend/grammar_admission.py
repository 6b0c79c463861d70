"""Grammar compilation before admission: a request with ``response_format`` joins the scheduler only
once its grammar is compiled, on a background thread, so a step never waits for a compiler.

Why: xgrammar compiles a JSON schema in microseconds to many seconds (``{"pattern": "^[a-z]{1,8000}$"}``
took 6.7 s on one CPU core), and inside the step that froze every stream of the engine. xgrammar's
compiler releases the GIL, so the step keeps running beside it; its compiled-grammar cache is the one
the sampler reads (``GrammarBackend``, bounded), so the step's matcher is then a cache hit.

Bounded: one compile at a time; a compile that runs longer than ``timeout_s`` fails its request (400
naming ``response_format``) and is abandoned -- xgrammar cannot stop a compile, so its thread finishes
it in the background while a fresh thread takes the next grammars, so one bomb delays nobody else's
grammar. At most ``max_abandoned`` such compiles may still be running (each holds a core until it ends);
beyond that, and beyond ``max_pending`` waiting requests, new grammars are refused (400, retry later).

    AddRequest(json_schema) -> submit() --compile thread--> poll(): ready  -> engine.add_request
                                                                     refused -> Rejected(response_format)
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from engine.errors import InvalidRequestError
from engine.worker.grammar import GrammarBackend
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
COMPILE_TIMEOUT_S = 5.0
MAX_PENDING = 32
MAX_ABANDONED = 2


@dataclass
class _Pending(Generic[T]):
    item: T
    so: StructuredOutput
    submitted: float
    future: Future | None = None
    started: list[float] = field(default_factory=list)  # set by the compile thread when it begins


class GrammarAdmission(Generic[T]):
    """Holds requests (``T``: whatever the caller admits later) while their grammars compile."""

    def __init__(self, backend: GrammarBackend, vocab_size: int, on_done: Callable[[], None] = lambda: None,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_pending: int = MAX_PENDING,
                 max_abandoned: int = MAX_ABANDONED) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_abandoned = max_abandoned
        self._on_done = on_done  # wakes the engine loop when a compile ends
        self._pool = self._new_pool()
        self._pending: dict[str, _Pending[T]] = {}
        self._abandoned: list[Future] = []  # compiles past their limit, still running

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, so: StructuredOutput, item: T) -> None:
        """Start compiling ``so`` for ``request_id``; ``item`` comes back from ``poll`` when admitted."""
        self._abandoned = [f for f in self._abandoned if not f.done()]
        if len(self._pending) >= self.max_pending or len(self._abandoned) >= self.max_abandoned:
            raise InvalidRequestError("response_format", f"the grammar compiler is saturated ({len(self._pending)} "
                                                         f"waiting, {len(self._abandoned)} over their time limit); "
                                                         "retry shortly")
        p = self._pending[request_id] = _Pending(item, so, time.monotonic())
        self._start(p)

    def _start(self, p: _Pending[T]) -> None:
        started = p.started

        def compile_() -> Any:
            started.append(time.monotonic())
            return self.backend.compile(p.so, self.vocab_size)

        p.future = self._pool.submit(compile_)
        p.future.add_done_callback(lambda _: self._on_done())

    def _abandon(self, running: Future) -> None:
        """Leave ``running`` to finish on its thread; the grammars queued behind it go to a fresh one."""
        self._abandoned.append(running)
        old, self._pool = self._pool, self._new_pool()
        for p in self._pending.values():
            if p.future is not None and p.future.cancel():  # queued on the old thread, not started
                self._start(p)
        old.shutdown(wait=False)

    def discard(self, request_id: str) -> bool:
        """Forget a request (aborted while its grammar compiles); True if it was waiting here."""
        p = self._pending.pop(request_id, None)
        if p is not None and p.future is not None:
            p.future.cancel()  # not started yet: never runs
        return p is not None

    def poll(self, now: float | None = None) -> tuple[list[T], list[tuple[T, str]]]:
        """The requests whose grammar is ready, and those refused with why (compile error or time)."""
        now = time.monotonic() if now is None else now
        ready: list[T] = []
        refused: list[tuple[T, str]] = []
        for rid, p in list(self._pending.items()):
            fut = p.future
            assert fut is not None
            if fut.done() and not fut.cancelled():
                exc = fut.exception()
                if exc is None:
                    ready.append(p.item)
                else:
                    refused.append((p.item, f"the grammar does not compile: {type(exc).__name__}: {exc}"))
            elif p.started and now - p.started[0] > self.timeout_s:
                refused.append((p.item, f"the grammar did not compile within {self.timeout_s:g}s; simplify the schema"))
                logger.warning("request %s: grammar compile passed %.1fs; refused, left to finish in the background",
                               rid, now - p.started[0])
                self._abandon(fut)
            else:
                continue
            del self._pending[rid]
        return ready, refused

    def next_deadline(self, now: float | None = None) -> float | None:
        """Seconds until the earliest running compile passes its limit (None: nothing pending; a small
        step while compiles only wait, so the loop looks again soon)."""
        if not self._pending:
            return None
        now = time.monotonic() if now is None else now
        running = [p.started[0] + self.timeout_s - now for p in self._pending.values() if p.started]
        return max(0.0, min(running)) if running else 0.05

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
