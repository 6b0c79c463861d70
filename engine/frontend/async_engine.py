"""``AsyncLLMEngine``: the asyncio front of ``LLMEngine`` in the same process (an ``EngineClient``).

A background task steps the engine in a worker thread whenever it has work; each request's deltas go
to its own queue. The serving layer uses it at TP > 1 (the model runs in the TP worker actors);
at TP = 1 it uses ``EngineProcess``, the same interface over an engine in a child process.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.core.detokenizer import token_text
from engine.core.engine import LLMEngine
from engine.errors import (EngineDeadError, EngineUnavailableError, InvalidRequestError, RequestAbortedError,
                           RequestFailedError, stream_error)
from engine.frontend.grammar_admission import COMPILE_TIMEOUT_S, MAX_ABANDONED
from engine.core.executor import ExecutorFactory
from engine.core.input_processor import Anchor
from engine.frontend.deltas import ChoiceStreams
from engine.frontend.token_bus import Address, TokenOutbox
from engine.outputs import TokenDelta
from engine.sampling_params import SamplingParams
from engine.core.stats import EngineStats

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Asyncio front of ``LLMEngine``: a background loop steps the engine in a worker thread.

    ``generate`` returns an async iterator of ``TokenDelta``s (``n`` choices fan out here,
    engine/frontend/deltas.py); leaving the iterator early (or cancelling its task, as a disconnecting
    HTTP client does) aborts the request and frees its blocks.

    Watchdog: a step that has not returned after ``watchdog_s`` (a hung worker, a collective that
    never completes) marks the engine dead: every stream gets ``EngineDeadError`` ("engine hung ...",
    HTTP 503), ``hung`` says so, and ``check_health`` raises, so Serve replaces the replica (a thread
    stuck in a step cannot be stopped from here).
    """

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None,
                 watchdog_s: float = 60.0) -> None:
        if watchdog_s <= 0:
            raise ValueError(f"watchdog_s must be > 0, got {watchdog_s}")
        self.watchdog_s = watchdog_s
        self.hung = False
        self._step_started: float | None = None  # monotonic start of the step in flight
        self._watch_task: asyncio.Task[None] | None = None
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._abandoned: list[Future[Any]] = []  # compiles past their limit, still running on their thread
        self.engine = LLMEngine(config, executor_factory)
        self.tokenizer = self.engine.tokenizer
        self._streams = ChoiceStreams(lambda: token_text(self.tokenizer))
        self._queues: dict[str, asyncio.Queue[TokenDelta | BaseException]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._dead: str | None = None  # why the loop died
        self._stopping = False
        self._outbox: TokenOutbox | None = None  # made on the first stream()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def _ensure_loop(self) -> None:
        if self._dead is not None:
            raise EngineUnavailableError(f"engine loop died: {self._dead}")
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dead is None and not self._stopping:
            await asyncio.sleep(min(1.0, self.watchdog_s / 4))
            started = self._step_started
            if started is not None and loop.time() - started > self.watchdog_s:
                self.hung = True
                self._fail(f"engine hung: a step has not returned for {loop.time() - started:.1f}s "
                           f"(watchdog_s={self.watchdog_s:g})")

    def _fail(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"engine loop died: {reason}"))

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while not self._stopping:
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                self._step_started = asyncio.get_running_loop().time()
                outputs = await asyncio.to_thread(self.engine.step)
                self._step_started = None
                if self._dead is not None:  # the watchdog gave up on this step
                    return
                for out in outputs:
                    taken = self._streams.take(out)
                    if taken is None:
                        continue
                    q = self._queues.get(taken[0])
                    if q is not None:
                        q.put_nowait(taken[1])
        except Exception as exc:  # noqa: BLE001 - any failure kills the loop; callers must hear of it
            logger.exception("engine loop died")
            self._fail(repr(exc))

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        anchors: Iterable[Anchor] | None = None,
        session: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of one request. Validation errors raise before the first delta; so does a
        grammar (``response_format``) that does not compile within ``COMPILE_TIMEOUT_S``."""
        self._ensure_loop()
        if params.structured_output is not None:
            await self._compile(params.structured_output)
        request_id = request_id or uuid.uuid4().hex
        try:
            choices = self._streams.open(request_id, params)
        except ValueError as e:
            raise InvalidRequestError("request_id", str(e)) from None
        try:
            for eid, p in choices:  # a session's KV is one conversation's: a single choice only
                self.engine.add_request(eid, prompt, p, anchors, session=session if len(choices) == 1 else None)
        except BaseException:
            for eid in self._streams.close(request_id):
                self.engine.abort(eid)
            raise
        queue: asyncio.Queue[TokenDelta | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            for eid in self._streams.close(request_id):  # unfinished (left early, or a choice failed)
                self.engine.abort(eid)

    async def stream(
        self,
        reply_to: Address,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str,
        anchors: Iterable[Anchor] | None = None,
        session: str | None = None,
    ) -> None:
        """``EngineProcess.stream`` for the engine in this process (TP > 1): the deltas, or the error that
        ends the request, go to the token-bus inbox ``reply_to`` from here. Raises ``EngineDeadError``
        when the engine loop is dead; cancelling aborts the request."""
        if self._outbox is None:
            self._outbox = TokenOutbox()
        try:
            async for delta in self.generate(prompt, params, request_id, anchors, session):
                self._outbox.send(reply_to, request_id, delta)
        except (InvalidRequestError, RequestAbortedError, RequestFailedError) as e:  # this request's end
            self._outbox.send(reply_to, request_id, stream_error(e))
        await self._outbox.drain(reply_to)

    async def _compile(self, so: Any) -> None:
        """Compile the grammar before admission, on one thread beside the step (xgrammar releases the GIL),
        within ``COMPILE_TIMEOUT_S`` or a 400 naming ``response_format``. At TP > 1 the sampling rank
        compiles it once more in its step; this bounds how long that can take."""
        # Each abandoned compile holds a core until it ends: as at TP = 1 (engine/frontend/grammar_admission.py),
        # a few at most, or a flood of grammar bombs would start a thread (and take a core) for each.
        self._abandoned = [f for f in self._abandoned if not f.done()]
        if len(self._abandoned) >= MAX_ABANDONED:
            raise InvalidRequestError("response_format", f"the grammar compiler is saturated ({len(self._abandoned)} "
                                                         "compiles over their time limit still running); retry shortly")
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        running = self._grammar_pool.submit(self.engine.grammar.compile, so, self.engine.shape.vocab_size)
        try:
            await asyncio.wait_for(asyncio.wrap_future(running), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            # Abandoned (xgrammar cannot stop it): it finishes on its thread, the next grammar gets a fresh one.
            if not running.cancel():  # queued behind another compile: never runs; else it runs on
                self._abandoned.append(running)
            old, self._grammar_pool = self._grammar_pool, None
            old.shutdown(wait=False)
            raise InvalidRequestError("response_format", f"the grammar did not compile within {COMPILE_TIMEOUT_S:g}s; "
                                                         "simplify the schema") from None
        except Exception as e:  # noqa: BLE001 - xgrammar's errors have no common base
            raise InvalidRequestError("response_format", f"the grammar does not compile: {type(e).__name__}: {e}") from None

    def abort(self, request_id: str) -> None:
        """Abort a request (every choice); its stream raises ``RequestAbortedError``."""
        for eid in self._streams.close(request_id):
            self.engine.abort(eid)
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(RequestAbortedError(f"request {request_id} was aborted"))
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> EngineStats:
        bus = self._outbox
        return replace(self.engine.stats(), token_bus_frames=bus.frames if bus else 0,
                       token_bus_deltas=bus.deltas if bus else 0)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineUnavailableError(f"engine loop died: {self._dead}")

    def set_cache_policy(self, policy: CachePolicy) -> str:
        return self.engine.set_cache_policy(policy)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``drain_timeout`` seconds), then stop the loop."""
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while self.engine.has_unfinished() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=5)
        if self._outbox is not None:
            await self._outbox.close()
        self.engine.shutdown()
