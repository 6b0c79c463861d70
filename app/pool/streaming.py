"""Streaming a planned request from its pool: the request path's one return channel.

::

    ingress                                              pool replica (LLMServer.generate)
    -------                                              ---------------------------------
    inbox.open(request_id) -> queue
    pool.generate.remote(PoolRequest(reply_to=inbox)) -> engine.generate(...)
    queue <== TokenDelta, TokenDelta, ... ============== outbox.send(reply_to, ...)   (token bus,
    queue <== or one APIError (refused / failed) ======= outbox.send(reply_to, ...)    one frame
    call returns (after the last frame was written) <--                                 per step)

Everything the pool says -- tokens, refusals, errors -- arrives on the token bus, in order. The
Serve call is the request and its cancellation: cancelling it (client gone, per-bucket timeout)
aborts the request in the engine, which frees its blocks at once; Serve's own refusals (queue full
-> 503) and a replica that died surface as the call's exception. Slow consumers get the deltas
that piled up merged into one (:func:`coalesced`), so a hop never falls further behind.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, TypeVar

from app.errors import APIError
from app.events import RoutePlan, RouteInfo, TokenDelta
from engine.frontend.token_bus import TokenInbox
from engine.outputs import merge_deltas

logger = logging.getLogger("sinkserve.streaming")

T = TypeVar("T")
_END = object()
_TIMEOUT = object()
_CALL_END = object()


async def coalesced(source: AsyncIterator[T], timeout_s: float | None = None) -> AsyncIterator[T]:
    """Yield from ``source``, merging consecutive unfinished ``TokenDelta``s that are already waiting.

    Under light load every delta still goes out alone (no added latency); under heavy load the
    number of messages drops to what the consumer can take. ``source`` is pumped by a task; closing
    this generator cancels it, which closes ``source``. With ``timeout_s`` the whole stream must end
    in time or ``asyncio.TimeoutError`` is raised: one timer per stream, not a ``wait_for`` per token.
    """
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    timer = loop.call_later(timeout_s, queue.put_nowait, _TIMEOUT) if timeout_s is not None else None

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the consumer raises it
            queue.put_nowait(e)

    task = loop.create_task(pump())
    try:
        while True:
            item = await queue.get()
            while (
                isinstance(item, TokenDelta)
                and not item.finished
                and item.finish_reason is None  # a choice that ended (n > 1) stays its own delta
                and not queue.empty()
                and isinstance(queue._queue[0], TokenDelta)  # noqa: SLF001 - peek, single consumer
                and queue._queue[0].index == item.index  # noqa: SLF001 - deltas of one choice only
            ):
                item = merge_deltas(item, queue.get_nowait())
            if item is _END:
                return
            if item is _TIMEOUT:
                raise asyncio.TimeoutError(f"stream did not finish within {timeout_s}s")
            if isinstance(item, BaseException) and not isinstance(item, APIError):
                raise item
            yield item
            if isinstance(item, APIError) or (isinstance(item, TokenDelta) and item.finished):
                return
    finally:
        if timer is not None:
            timer.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass


async def bus_stream(call: Any, queue: asyncio.Queue[Any], grace_s: float = 10.0) -> AsyncIterator[TokenDelta | APIError]:
    """The items the bus puts in ``queue`` (deltas, or an ``APIError``), while the pool call is
    watched: its exception (queue full, replica died) ends the stream; its return means the pool
    wrote its last item, so that must arrive within ``grace_s``."""

    async def watch() -> None:
        try:
            await call
            queue.put_nowait(_CALL_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - raised by the consumer below
            queue.put_nowait(e)

    watcher = asyncio.get_running_loop().create_task(watch())
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
            if isinstance(item, BaseException) and not isinstance(item, APIError):
                raise item
            yield item
            if isinstance(item, APIError) or item.finished:
                return
    finally:
        watcher.cancel()


# Retry-After of a 503 for a pool with no live replica: Serve starts a replacement in tens of seconds.
NO_REPLICA_RETRY_AFTER_S = 5
TIME_LIMIT = "time_limit"  # finish_reason of a generation ended by its pool's soft timeout


async def taken_by_replica(call: Any, wait_s: float, pool_ready: Callable[[], bool]) -> bool:
    """Whether a replica took ``call``: True once Serve's router assigned it to one; False when, at a
    ``wait_s`` deadline, none has and ``pool_ready()`` says the pool has no live replica (the ingress:
    neither the hub nor its own Serve router lists one) -- its only replica (or node) was lost and
    Serve holds the call until a replacement runs (a minute on a loaded host).
    While the pool is ready (its replicas are busy: Serve queues the call) the wait goes on, one
    ``wait_s`` at a time. A request that no replica took never reached an engine, so it may go
    elsewhere (app/pool/failover.py)::

        t=0 call sent (router: no live replica) -- t=wait_s: hub still sees the pool ready (its TTL)
        -> wait -- t=2*wait_s: hub sees none -> False (the caller cancels the call: 503 or failover)

    Reads Serve's own assignment future (``DeploymentResponse._fetch_future_result_async``, Ray 2.x);
    a call without one (a test double) counts as taken at once."""
    fetch = getattr(call, "_fetch_future_result_async", None)
    if fetch is None:
        return True
    task = asyncio.ensure_future(fetch())
    # Never cancelled from here: the task awaits the call's own assignment future, and cancelling it would
    # cancel the call (the stream beside this watch still reads it). Its outcome is the call's to report.
    task.add_done_callback(lambda f: f.cancelled() or f.exception())
    while True:
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if done:
            return True  # assigned, or failed: awaiting the call raises that failure (bus_stream)
        if not pool_ready():
            return False


def _replica_gone(e: BaseException) -> bool:
    """The pool call failed because its replica died (Serve drops it from the routing set)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


async def stream_plan(pool: Any, plan: RoutePlan, inbox: TokenInbox, replica_wait_s: float | None = None,
                      pool_ready: Callable[[], bool] = lambda: True) -> AsyncIterator[RouteInfo | TokenDelta | APIError]:
    """``RouteInfo`` then ``TokenDelta``s (the last finished), or an ``APIError`` (first, or after
    some deltas). However this generator ends early (client gone, timeout), the pool call is
    cancelled, which aborts the request in the engine.

    Timeouts: at the pool's ``soft_timeout_s`` generation ends cleanly -- the call is cancelled and
    every unfinished choice gets a last, empty delta with ``finish_reason: "time_limit"``, so the
    client keeps the partial output; without one, ``timeout_s`` ends the stream with a 408. A call
    whose replica died before it produced anything is sent once more (Serve routes it to a live
    replica; a conversation's next replica re-prefills its history). With ``replica_wait_s``, a call
    that no replica takes while ``pool_ready()`` says the pool has none (:func:`taken_by_replica`)
    ends with a 503 "unavailable" naming the pool (app/pool/failover.py moves it to another pool)."""
    info, preq = plan.info, plan.request
    soft = preq.soft_timeout_s
    timeout_s = soft or preq.timeout_s or 3600.0
    started = False
    counts: dict[int, int] = {}  # choice -> completion tokens so far
    open_choices = set(range(preq.params.n))
    prompt_tokens = info.prompt_tokens
    for attempt in (0, 1):
        try:
            queue = inbox.open(info.request_id)  # before the call: the first frame may beat its start
        except ValueError as e:  # a handle caller reused a request id
            yield APIError(400, str(e), "request_id")
            return
        call = pool.generate.remote(replace(preq, reply_to=inbox.address))
        done = False
        watch: asyncio.Future[bool] | None = None
        try:
            # The replica watch runs beside the stream, never in front of it: Serve may resolve a unary
            # call's assignment late, and tokens waiting behind it would reach the client in one lump.
            watch = (asyncio.ensure_future(taken_by_replica(call, replica_wait_s, pool_ready))
                     if replica_wait_s is not None else None)
            # aclosing: returning early still closes the coalescer at once (its timer and pump task).
            async with aclosing(coalesced(bus_stream(call, queue), timeout_s)) as source:
                while True:
                    nxt = asyncio.ensure_future(source.__anext__())
                    if watch is not None:
                        await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
                        if not nxt.done() and not watch.result():
                            nxt.cancel()
                            await asyncio.wait({nxt})  # let the generator unwind before aclosing closes it
                            logger.warning("request %s: no live replica of %s took it within %.1fs", info.request_id,
                                           info.deployment, replica_wait_s)
                            yield APIError(503, f"pool {info.pool!r} has no live replica (none took the request within "
                                           f"{replica_wait_s:g}s; its replica or node was lost and is being replaced); "
                                           "retry shortly", type="unavailable", retry_after=NO_REPLICA_RETRY_AFTER_S)
                            return
                        watch.cancel()  # something arrived, or a replica took it: nothing left to watch
                        watch = None
                    try:
                        ev = await nxt
                    except StopAsyncIteration:
                        break
                    if not started:
                        started = True
                        if not isinstance(ev, APIError):
                            yield info
                    if isinstance(ev, TokenDelta):
                        counts[ev.index] = ev.completion_tokens
                        prompt_tokens = ev.prompt_tokens
                        if ev.finish_reason is not None:
                            open_choices.discard(ev.index)
                    yield ev
                    if isinstance(ev, APIError) or ev.finished:
                        done = True
                        return
                done = True
                return
        except asyncio.TimeoutError:
            if soft is None:
                logger.info("request %s timed out after %.1fs in %s", info.request_id, timeout_s, info.deployment)
                yield APIError(408, f"request timed out after {timeout_s:g}s in pool {info.pool!r}", type="timeout")
                return
            logger.info("request %s reached the soft timeout (%.1fs) in %s", info.request_id, soft, info.deployment)
            if not started:
                yield info
            last = sorted(open_choices)
            for i in last:
                yield TokenDelta("", (), None, i == last[-1], TIME_LIMIT, prompt_tokens, counts.get(i, 0), index=i)
            return
        except Exception as e:
            from ray.serve.exceptions import BackPressureError

            if isinstance(e, BackPressureError):
                yield APIError(503, f"pool {info.pool!r} is at capacity; retry later", type="overloaded", retry_after=1)
                return
            if attempt == 0 and not started and _replica_gone(e):
                logger.warning("request %s: replica of %s died before answering (%s); sending it again",
                               info.request_id, info.deployment, type(e).__name__)
                continue
            if started and _replica_gone(e):
                # Its replica stopped mid-stream (its process, or the node under it, was lost): the client
                # keeps what it got and learns why; a retry goes to a live replica (or the one Serve starts
                # elsewhere), and a conversation's retry re-prefills its history there.
                logger.warning("request %s: replica of %s lost mid-stream (%s)", info.request_id, info.deployment,
                               type(e).__name__)
                yield APIError(503, f"pool {info.pool!r} lost the replica serving this request mid-stream "
                               "(its process or node stopped); retry", type="unavailable", retry_after=1)
                return
            if not started and _replica_gone(e):  # twice: the pool has no live replica now (app/pool/failover.py)
                yield APIError(503, f"pool {info.pool!r} has no live replica; retry shortly", type="unavailable",
                               retry_after=NO_REPLICA_RETRY_AFTER_S)
                return
            logger.exception("request %s failed in %s", info.request_id, info.deployment)
            yield APIError(500, f"internal error in pool {info.pool!r}: {type(e).__name__}", type="server_error")
            return
        finally:
            if watch is not None:
                watch.cancel()
            if not done:
                call.cancel()
            inbox.close(info.request_id)
