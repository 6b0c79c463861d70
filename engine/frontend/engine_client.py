"""``EngineClient``: the one interface the serving layer drives an engine through.

Two implementations: ``AsyncLLMEngine`` (the engine in this process; TP workers elsewhere) and
``EngineProcess`` (the engine stepping in a child process). The pool replica holds an
``EngineClient`` and never needs to know which one. Serving streams with ``stream`` (the deltas go
straight from the engine's front to the ingress's token-bus inbox); ``generate`` iterates them here
(jobs, the CLI, tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence as Seq
from typing import Protocol, runtime_checkable

from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.core.input_processor import Anchor
from engine.frontend.token_bus import Address
from engine.outputs import TokenDelta
from engine.sampling_params import SamplingParams
from engine.core.stats import EngineStats


@runtime_checkable
class EngineClient(Protocol):
    """Streaming generation plus the control calls a serving replica needs."""

    @property
    def config(self) -> EngineConfig: ...

    def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        anchors: Iterable[Anchor] | None = None,
        session: str | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Deltas of one request, every choice of its ``n`` (engine/frontend/deltas.py), the last one
        ``finished``; an invalid request raises ``InvalidRequestError`` before the first, and leaving the
        iterator early aborts the request (its blocks are freed). ``session``: the conversation the
        request is a turn of (session KV: ``engine/memory/session_cache.py``)."""
        ...

    async def stream(
        self,
        reply_to: Address,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str,
        anchors: Iterable[Anchor] | None = None,
        session: str | None = None,
    ) -> None:
        """The request's deltas -- or the error that ends it (``engine.errors.StreamError``) -- written to
        the token-bus inbox ``reply_to`` from where the engine steps (engine/frontend/token_bus.py); returns
        when the last is on its way. Raises ``EngineDeadError`` when the engine cannot run it; cancelling
        aborts it."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def check_health(self) -> None:
        """Raise ``EngineDeadError`` when the engine can no longer step."""
        ...

    def set_cache_policy(self, policy: CachePolicy) -> str:
        """Apply ``policy`` to future steps; returns its version."""
        ...

    async def shutdown(self, drain_timeout: float = 30.0) -> None: ...
