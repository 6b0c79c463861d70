"""``AsyncLLMEngine``: the asyncio front of ``LLMEngine`` in the same process (an ``EngineClient``).

A background task steps the engine in a worker thread whenever it has work; each request's deltas go
to its own queue. The serving layer uses it at TP > 1 (the model runs in the TP worker actors);
at TP = 1 it uses ``EngineProcess``, the same interface over an engine in a child process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence as Seq
from typing import Any

from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import EngineDeadError, RequestAbortedError, RequestFailedError
from engine.executor import ExecutorFactory
from engine.input_processor import Anchor
from engine.outputs import RequestOutput, next_delta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Asyncio front of ``LLMEngine``: a background loop steps the engine in a worker thread.

    ``generate`` returns an async iterator of ``RequestOutput`` deltas; leaving the iterator early (or
    cancelling its task, as a disconnecting HTTP client does) aborts the request and frees its blocks.
    """

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        self.engine = LLMEngine(config, executor_factory)
        self.tokenizer = self.engine.tokenizer
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._dead: BaseException | None = None
        self._stopping = False

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def _ensure_loop(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while not self._stopping:
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                outputs = await asyncio.to_thread(self.engine.step)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
        except Exception as exc:  # noqa: BLE001 - any failure kills the loop; callers must hear of it
            logger.exception("engine loop died")
            self._dead = exc
            for q in self._queues.values():
                q.put_nowait(EngineDeadError(f"engine loop died: {exc!r}"))

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        anchors: Iterable[Anchor] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request. Validation errors raise before the first delta."""
        self._ensure_loop()
        request_id = self.engine.add_request(request_id, prompt, params, anchors)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        assert self._wakeup is not None
        self._wakeup.set()
        done = False  # the engine is through with it (finished or aborted)
        try:
            while not done:
                item = await next_delta(queue, request_id)
                done = item.finished
                yield item
        except (RequestAbortedError, RequestFailedError):  # the engine is through with it
            done = True
            raise
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")

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
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=5)
        self.engine.shutdown()
