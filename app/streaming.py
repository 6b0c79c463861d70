"""Stream a planned request from its pool: the one streaming hop of the request path.

Used by the ingress (HTTP) and by ``Router.route`` (Ray handle callers entering at the router).
Owns the per-bucket timeout (408), queue-full shedding (503 from Serve's ``BackPressureError``) and
the cancel-on-exit rule: however this generator ends early (client gone, timeout, error), the pool
call is cancelled, which aborts the request in the engine and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from app.coalesce import coalesced
from app.events import ErrorEvent, RoutePlan, RouteInfo, TokenDelta

logger = logging.getLogger("sinkserve.streaming")


async def stream_plan(pool: Any, plan: RoutePlan) -> AsyncIterator[RouteInfo | TokenDelta | ErrorEvent]:
    """``RouteInfo`` then ``TokenDelta``s (the last finished), or one ``ErrorEvent``."""
    info, preq = plan.info, plan.request
    timeout_s = preq.timeout_s or 3600.0
    stream = pool.options(stream=True).generate.remote(preq)
    started = done = False
    try:
        # aclosing: returning early still closes the coalescer at once (its timer and pump task).
        async with aclosing(coalesced(stream, timeout_s)) as source:
            async for ev in source:
                if not started:
                    started = True
                    if not isinstance(ev, ErrorEvent):
                        yield info
                yield ev
                if isinstance(ev, ErrorEvent) or (isinstance(ev, TokenDelta) and ev.finished):
                    done = True
                    return
            done = True
    except asyncio.TimeoutError:
        logger.info("request %s timed out after %.1fs in %s", info.request_id, timeout_s, info.deployment)
        yield ErrorEvent(408, f"request timed out after {timeout_s:g}s in pool {info.pool!r}", type="timeout")
    except Exception as e:
        from ray.serve.exceptions import BackPressureError

        if isinstance(e, BackPressureError):
            yield ErrorEvent(503, f"pool {info.pool!r} is at capacity; retry later", retry_after=1, type="overloaded")
            return
        logger.exception("request %s failed in %s", info.request_id, info.deployment)
        yield ErrorEvent(500, f"internal error in pool {info.pool!r}: {type(e).__name__}", type="server_error")
    finally:
        if not done:
            stream.cancel()
