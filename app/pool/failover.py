"""Failover between pools: while a request's pool has no live engine, a prompt that another pool can
serve goes there.

Two triggers, both before the request's first token (a stream that started stays where it is):

- the pool is known to be down: no replica of its deployment reports itself ready to the hub (an
  engine that died or hung reports not ready at once, ``LLMServer._entry``) -- the request goes straight
  to a pool that is up;
- the pool answers that it cannot take it: 503 "engine unavailable" (its engine had died and is
  restarting) or no live replica after the one resend -- the request is sent to the next pool that
  fits. A request that was *in* an engine when it died or hung is not moved: it may be what killed it;
- no replica took the call within ``ingress.replica_wait_s`` while the hub sees none ready (the
  pool's only replica, or its node, was lost: Serve would hold the call until a replacement runs) --
  the call is cancelled and answered 503 "unavailable" (``stream_plan``), so it moves as above.

"Can serve" means the same model version, in a pool whose bucket holds the prompt (``max_prompt_tokens``);
a request that named its pool (``sinkserve.pool``) is never moved. Each move is counted
(``sinkserve_failover_total{from_pool, to_pool, reason}``). With nowhere to go, the client gets the 503
with ``Retry-After``. Example, pools short (<= 48 tokens) and long (<= 400), short's engine killed::

    30-token prompt -> short: 503 engine unavailable -> long: 200     (failover, reason "unavailable")
    300-token prompt -> long: 200                                    (short never fit it)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Sequence

from app.errors import APIError
from app.events import RouteInfo, RoutePlan, TokenDelta
from app.settings import BucketSpec, pool_deployment_name
from app.pool.prefix_affinity import prefix_key
from app.pool.streaming import stream_plan
from engine.frontend.token_bus import TokenInbox

UNAVAILABLE = "unavailable"  # the pool answered that it cannot serve now
NOT_READY = "not_ready"  # the hub says no replica of the pool is ready


def pool_unavailable(e: APIError) -> bool:
    """The pool could not take the request at all (its engine was dead already, no live replica) -- not
    "busy" (overloaded: 503 too, but the pool works; its overflow must not flood the scarcer pools), and
    not an engine that died while running it (type ``server_error``: the request may be what killed it,
    and must not take the next pool down too)."""
    return e.status == 503 and e.type == "unavailable"


def fallback_plans(plan: RoutePlan, buckets: Sequence[BucketSpec], deployments: Sequence[str]) -> list[RoutePlan]:
    """The same request in every other pool that can serve it, smallest bucket first, with the routing key
    that pool's router expects."""
    info = plan.info
    out = []
    for b in sorted(buckets, key=lambda b: b.max_prompt_tokens):
        name = pool_deployment_name(b.name, info.version)
        if b.name == info.pool or info.prompt_tokens > b.max_prompt_tokens or name not in deployments:
            continue
        if b.versions is not None and info.version not in b.versions:
            continue
        req = plan.request
        if req.affinity is None:
            # A prefix key hashes the first pool's whole blocks up to its prefix_affinity_tokens; this pool may
            # cut other blocks, or route without one. (A session's key is the same in every pool.)
            req = replace(req, prefix_affinity=prefix_key(req.prompt_token_ids, b.block_size,
                                                          b.prefix_affinity_tokens))
        out.append(replace(plan, info=replace(info, pool=b.name, deployment=name), request=req))
    return out


async def stream_with_failover(
    plan: RoutePlan,
    fallbacks: Sequence[RoutePlan],
    pools: dict[str, Any],
    inbox: TokenInbox,
    ready: Callable[[str], bool],
    on_failover: Callable[[str, str, str], None],
    replica_wait_s: float | None = None,
) -> AsyncIterator[RouteInfo | TokenDelta | APIError]:
    """``stream_plan`` of ``plan``, or of the first fallback that can take it (see the module docstring).
    ``ready(deployment)``: whether the hub last saw a ready replica of it; ``on_failover(from, to, reason)``
    counts a move; ``replica_wait_s``: how long a call may wait for a replica of a pool the hub sees
    none ready of (``stream_plan``)."""
    candidates = [plan, *fallbacks]
    if not ready(plan.info.deployment):  # known down: start with the first fallback that is up
        up = [p for p in fallbacks if ready(p.info.deployment)]
        if up:
            on_failover(plan.info.pool, up[0].info.pool, NOT_READY)
            candidates = [*up, plan]
    for i, p in enumerate(candidates):
        last = i == len(candidates) - 1
        gen = stream_plan(pools[p.info.deployment], p, inbox, replica_wait_s=replica_wait_s,
                          pool_ready=lambda d=p.info.deployment: ready(d))
        try:
            first = await gen.__anext__()
            if isinstance(first, APIError) and pool_unavailable(first) and not last:
                on_failover(p.info.pool, candidates[i + 1].info.pool, UNAVAILABLE)
                continue
            yield first
            async for ev in gen:
                yield ev
            return
        except StopAsyncIteration:
            return
        finally:
            await gen.aclose()
