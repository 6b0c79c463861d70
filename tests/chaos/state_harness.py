"""A real ``Ingress`` on a real store, without Ray: the chaos cases of issue 43 item 4.

The Serve-decorated ``Ingress`` is built with its own ``__init__`` (auth, planner with the reference
model's tokenizer, store, token-bus inbox) and served by its FastAPI app through
``httpx.ASGITransport``; Serve's "which replica am I" lookup is pointed at it. Pools
are :class:`FakePool`: each request's deltas travel back on the real token bus, so everything from
the HTTP body to the store is the product's code; only the engine is absent.
"""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

import httpx

from app.events import PoolRequest, TokenDelta
from app.settings import REPO_ROOT, BucketSpec, IngressArgs, IngressSpec, PlanSpec, QuotaArgs, StoreArgs, TenantArgs, VersionSpec
from engine.frontend.token_bus import TokenOutbox

MODEL = str(REPO_ROOT / "assets/reference-model")
KEY, ACME_KEY, OPERATOR_KEY = "chaos-key", "chaos-acme", "chaos-operator"
DEPLOYMENTS = ("pool-chat-v1", "pool-chat-v2")  # version v2 takes no traffic (weight 0)


class FakePool:
    """A pool replica's ``generate``: ``tokens`` tokens (0: one empty final delta), one every
    ``delay_s``, sent to the request's token-bus inbox like ``LLMServer.generate``."""

    def __init__(self, tokens: int = 2, delay_s: float = 0.0, error: Any = None) -> None:
        self.tokens = tokens
        self.delay_s = delay_s
        self.error = error  # an APIError to answer every request with (a refusal), instead of tokens
        self.outbox = TokenOutbox()
        self.calls = 0

    def options(self, **_: Any) -> "FakePool":
        return self

    @property
    def generate(self) -> "FakePool":
        return self

    def remote(self, req: PoolRequest) -> "asyncio.Task[None]":
        self.calls += 1
        return asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: PoolRequest) -> None:
        n = len(req.prompt_token_ids)
        if self.error is not None:
            await asyncio.sleep(self.delay_s)
            self.outbox.send(req.reply_to, req.request_id, self.error.stream_error())
            await self.outbox.drain(req.reply_to)
            return
        if self.tokens == 0:
            await asyncio.sleep(self.delay_s)
            self.outbox.send(req.reply_to, req.request_id, TokenDelta("", (), None, True, "length", n, 0))
        for i in range(self.tokens):
            await asyncio.sleep(self.delay_s)
            last = i == self.tokens - 1
            self.outbox.send(req.reply_to, req.request_id,
                             TokenDelta(f" t{i}", (40 + i,), None, last, "length" if last else None, n, i + 1))
        await self.outbox.drain(req.reply_to)


def ingress_spec(store: StoreArgs, tenants: dict[str, TenantArgs] | None = None, fail_closed: bool = False) -> IngressSpec:
    # Wide enough that a conversation of a chaos run (hundreds of short turns on a quiet host) never
    # outgrows it: the fake pools hold no KV.
    plan = PlanSpec(buckets=(BucketSpec("chat", 16000, 30.0, max_seq_len=16384),),
                    versions=(VersionSpec("v1", MODEL, 1.0), VersionSpec("v2", MODEL, 0.0)))
    return IngressSpec(auth="enabled", served_model_name="ref", plan=plan, pool_deployments=DEPLOYMENTS,
                       store=store, tenants=tuple((tenants or {}).items()), ingress=IngressArgs(keepalive_s=5.0),
                       quotas=QuotaArgs(fail_closed=fail_closed))


def _local_class() -> type:
    from app.http.ingress import Ingress

    class Local(Ingress):
        """The ingress outside Serve: its shutdown is awaited by the harness, not left to the GC."""

        def __del__(self) -> None:
            pass

    return Local


_Local = _local_class()


class _ReplicaContext:
    """What Serve's ``get_current_servable_instance`` dependency reads: the replica's object
    (round-robin over the harness's ingress replicas)."""

    def __init__(self, objs: list[Any]) -> None:
        self._next = itertools.cycle(objs)
        self.replica_tag = "chaos"

    @property
    def servable_object(self) -> Any:
        return next(self._next)


@asynccontextmanager
async def running_ingress(spec: IngressSpec, pool: FakePool, replicas: int = 1) -> AsyncIterator[tuple[httpx.AsyncClient, list[Any]]]:
    """``replicas`` ingress replicas sharing ``spec``'s store (requests go round-robin), and an
    HTTP client for them. ``SINKSERVE_API_KEYS`` / ``SINKSERVE_OPERATOR_KEYS`` must be set."""
    from app.http.ingress import Ingress, api

    base = Ingress.__bases__[0]  # the class under Serve's ASGI wrapper
    objs = []
    for _ in range(replicas):
        obj = _Local.__new__(_Local)
        await base.__init__(obj, spec, {d: pool for d in DEPLOYMENTS}, None)
        objs.append(obj)
    from ray import serve

    real = serve.get_replica_context
    ctx = _ReplicaContext(objs)
    serve.get_replica_context = lambda: ctx  # what the routes' ``self`` dependency asks
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://ingress",
                                     headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            yield client, objs
    finally:
        serve.get_replica_context = real
        for obj in objs:
            if obj._tasks:  # settling a request the client left: 5 s for all of them, not each
                await asyncio.wait(set(obj._tasks), timeout=5)
            await base.__del__(obj)
            for t in list(obj._tasks):
                t.cancel()


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [b[len("data: "):] for b in text.split("\n\n") if b.startswith("data: ")]


def keys_env(monkeypatch: Any) -> None:
    monkeypatch.setenv("SINKSERVE_API_KEYS", f"{KEY},{ACME_KEY}:acme")
    monkeypatch.setenv("SINKSERVE_OPERATOR_KEYS", f"{OPERATOR_KEY}:ops")
    monkeypatch.delenv("SINKSERVE_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("SINKSERVE_OPERATOR_KEYS_FILE", raising=False)


def statuses(responses: Sequence[httpx.Response]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in responses:
        out[r.status_code] = out.get(r.status_code, 0) + 1
    return out
