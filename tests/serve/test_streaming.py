"""stream_plan against a fake pool handle: timeout -> 408, queue full -> 503, cancel on early exit."""

from __future__ import annotations

import asyncio

from app.events import ErrorEvent, PoolRequest, RouteInfo, RoutePlan, TokenDelta
from app.streaming import stream_plan


class FakeStream:
    def __init__(self, items, delay=0.0, error=None):
        self.items, self.delay, self.error, self.cancelled = list(items), delay, error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        await asyncio.sleep(self.delay)
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class FakePool:
    """Mimics ``handle.options(stream=True).generate.remote(req)``."""

    def __init__(self, stream):
        self.stream = stream

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, _req):
        return self.stream


def plan(timeout_s=5.0):
    info = RouteInfo("r1", "short", "v1", "pool-short-v1", 3)
    return RoutePlan(info, PoolRequest("r1", (1, 2, 3), (), (), timeout_s))


def delta(i, fin=False):
    return TokenDelta(str(i), (i,), None, fin, "length" if fin else None, 3, i)


async def collect(gen, n=None):
    out = []
    async for ev in gen:
        out.append(ev)
        if n is not None and len(out) >= n:
            break
    return out


async def test_streams_route_info_then_deltas():
    s = FakeStream([delta(1), delta(2, fin=True)])
    evs = await collect(stream_plan(FakePool(s), plan()))
    assert isinstance(evs[0], RouteInfo) and evs[-1].finished and not s.cancelled


async def test_timeout_is_408_and_cancels_the_pool_call():
    s = FakeStream([delta(i) for i in range(1, 100)], delay=0.05)
    evs = await collect(stream_plan(FakePool(s), plan(timeout_s=0.2)))
    assert isinstance(evs[-1], ErrorEvent) and evs[-1].status == 408 and "0.2s" in evs[-1].message
    assert s.cancelled


async def test_queue_full_is_503_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    s = FakeStream([], error=BackPressureError(num_queued_requests=5, max_queued_requests=5))
    (ev,) = await collect(stream_plan(FakePool(s), plan()))
    assert ev.status == 503 and ev.retry_after == 1


async def test_early_exit_cancels_the_pool_call():
    s = FakeStream([delta(i) for i in range(1, 100)], delay=0.001)
    gen = stream_plan(FakePool(s), plan())
    await collect(gen, n=3)
    await gen.aclose()  # what a disconnecting client does to the ingress's generator
    assert s.cancelled


async def test_pool_error_event_passes_through():
    s = FakeStream([ErrorEvent(400, "prompt too long", field="prompt")])
    (ev,) = await collect(stream_plan(FakePool(s), plan()))
    assert ev.status == 400 and ev.field == "prompt" and not s.cancelled


def test_stream_plan_with_an_inbox_sends_reply_to_and_reads_the_rest_from_the_bus():
    from app.token_bus import TokenInbox, TokenOutbox

    class BusCall:
        """A pool call that puts every delta on the bus and yields nothing, as LLMServer does."""

        def __init__(self, req, outbox):
            self.req, self.outbox, self.cancelled = req, outbox, False

        async def _gen(self):
            if False:  # an async generator that yields nothing
                yield None
            for i in (1, 2, 3, 4):
                self.outbox.send(self.req.reply_to, self.req.request_id, delta(i, fin=i == 4))
            await self.outbox.drain(self.req.reply_to)

        def __aiter__(self):
            return self._gen()

        def cancel(self):
            self.cancelled = True

    class BusPool(FakePool):
        def __init__(self, outbox):
            self.outbox, self.calls = outbox, []

        def remote(self, req):
            self.calls.append(BusCall(req, self.outbox))
            return self.calls[-1]

    async def main():
        inbox, outbox = TokenInbox(), TokenOutbox()
        addr = await inbox.start("127.0.0.1")
        pool = BusPool(outbox)
        out = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
        assert pool.calls[0].req.reply_to == addr
        assert isinstance(out[0], RouteInfo)
        assert [t for d in out[1:] for t in d.token_ids] == [1, 2, 3, 4]  # (the ingress may merge waiting deltas)
        assert out[-1].finished and not pool.calls[0].cancelled
        assert inbox._queues == {}  # noqa: SLF001 - the request's queue is gone
        # Leaving early cancels the call and closes the queue too.
        gen = stream_plan(BusPool(outbox), plan(), inbox)
        assert isinstance(await gen.__anext__(), RouteInfo)
        await gen.aclose()
        assert inbox._queues == {}  # noqa: SLF001
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


def test_stream_plan_refuses_a_request_id_that_is_already_streaming_on_the_bus():
    from app.token_bus import TokenInbox

    async def main():
        inbox = TokenInbox()
        await inbox.start("127.0.0.1")
        inbox.open("r1")  # another stream with the same id is running
        pool = FakePool(FakeStream([delta(1, fin=True)]))
        out = await collect(stream_plan(pool, plan(), inbox))
        assert len(out) == 1 and out[0].status == 400 and out[0].field == "request_id"
        await inbox.stop()

    asyncio.run(main())
