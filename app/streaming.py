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
from dataclasses import replace
from typing import Any, AsyncIterator

from app.coalesce import coalesced, pump_into
from app.events import ErrorEvent, RoutePlan, RouteInfo, TokenDelta
from app.token_bus import TokenInbox

logger = logging.getLogger("sinkserve.streaming")


async def stream_plan(
    pool: Any, plan: RoutePlan, inbox: TokenInbox | None = None
) -> AsyncIterator[RouteInfo | TokenDelta | ErrorEvent]:
    """``RouteInfo`` then ``TokenDelta``s (the last finished), or one ``ErrorEvent``. With an
    ``inbox``, the deltas arrive on the token bus and the call carries only errors (app/token_bus.py)."""
    info, preq = plan.info, plan.request
    timeout_s = preq.timeout_s or 3600.0
    queue = None
    if inbox is not None and inbox.address is not None:
        try:
            queue = inbox.open(info.request_id)  # before the call: bus frames may beat its first item
        except ValueError as e:  # a handle caller reused a request id
            yield ErrorEvent(400, str(e), field="request_id")
            return
        preq = replace(preq, reply_to=inbox.address)
    stream = pool.options(stream=True).generate.remote(preq)
    started = done = False
    try:
        events = stream if queue is None else _with_bus(stream, queue)
        # aclosing: returning early still closes the coalescer at once (its timer and pump task).
        async with aclosing(coalesced(events, timeout_s)) as source:
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
        if queue is not None:
            inbox.close(info.request_id)


_CALL_END = object()


async def _with_bus(stream: Any, queue: asyncio.Queue[Any], grace_s: float = 10.0) -> AsyncIterator[Any]:
    """The deltas the bus puts in ``queue``, while the pool call is watched: an error it yields ends
    the stream; its end means the last delta was written, so that must arrive within ``grace_s``."""
    it = stream.__aiter__()
    # The call's errors, then its end, join the bus deltas in the same queue.
    watcher = asyncio.get_running_loop().create_task(pump_into(it, queue, _CALL_END))
    try:
        ended = False
        while True:
            if ended:
                try:
                    item = await asyncio.wait_for(queue.get(), grace_s)
                except asyncio.TimeoutError:
                    raise RuntimeError(f"the pool call ended but the last delta did not arrive within {grace_s:g}s") from None
            else:
                item = await queue.get()
            if item is _CALL_END:
                ended = True
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, ErrorEvent) or (isinstance(item, TokenDelta) and item.finished):
                return
    finally:
        watcher.cancel()
