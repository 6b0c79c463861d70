"""stream_plan against a fake pool that answers on a real token bus (loopback TCP), as LLMServer does:
route info then deltas, errors on the same channel, timeout -> 408 and cancel, queue full -> 503."""

from __future__ import annotations

import asyncio

import pytest

from app.errors import APIError
from app.events import PoolRequest, RouteInfo, RoutePlan, TokenDelta
from app.pool.streaming import stream_plan
from engine.frontend.token_bus import TokenInbox, TokenOutbox
from engine.sampling_params import SamplingParams


def delta(i, fin=False):
    return TokenDelta(str(i), (i,), None, fin, "length" if fin else None, 3, i)


class FakeCall:
    """A unary Serve call (awaitable, cancellable) whose body writes ``items`` to the caller's inbox."""

    def __init__(self, req, outbox, items, delay, error):
        self.req, self.cancelled = req, False
        self.task = asyncio.ensure_future(self._run(outbox, items, delay, error))

    async def _run(self, outbox, items, delay, error):
        if error is not None:
            raise error
        for item in items:
            await asyncio.sleep(delay)
            # an APIError goes on the bus as the pool replica sends it (its StreamError)
            outbox.send(self.req.reply_to, self.req.request_id,
                        item.stream_error() if isinstance(item, APIError) else item)
        await outbox.drain(self.req.reply_to)

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.cancelled = True
        self.task.cancel()


class FakePool:
    """Mimics ``handle.generate.remote(req)`` of a pool replica."""

    def __init__(self, outbox, items=(), delay=0.0, error=None):
        self.outbox, self.items, self.delay, self.error, self.calls = outbox, list(items), delay, error, []

    @property
    def generate(self):
        return self

    def remote(self, req):
        self.calls.append(FakeCall(req, self.outbox, self.items, self.delay, self.error))
        return self.calls[-1]


def plan(timeout_s=5.0):
    info = RouteInfo("r1", "short", "v1", "pool-short-v1", 3)
    return RoutePlan(info, PoolRequest("r1", (1, 2, 3), SamplingParams(), (), timeout_s))


async def collect(gen, n=None):
    out = []
    async for ev in gen:
        out.append(ev)
        if n is not None and len(out) >= n:
            break
    return out


@pytest.fixture()
async def bus():
    inbox, outbox = TokenInbox(error=APIError.from_stream_error), TokenOutbox()  # the ingress's inbox
    await inbox.start("127.0.0.1")
    yield inbox, outbox
    await outbox.close()
    await inbox.stop()


async def test_streams_route_info_then_deltas_from_the_bus(bus):
    inbox, outbox = bus
    pool = FakePool(outbox, [delta(i, fin=i == 4) for i in (1, 2, 3, 4)])
    out = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
    assert pool.calls[0].req.reply_to == inbox.address
    assert isinstance(out[0], RouteInfo)
    assert [t for d in out[1:] for t in d.token_ids] == [1, 2, 3, 4]  # (the ingress may merge waiting deltas)
    assert out[-1].finished and not pool.calls[0].cancelled
    assert inbox._queues == {}  # noqa: SLF001 - the request's queue is gone


async def test_pool_error_arrives_on_the_same_channel_and_is_the_only_event(bus):
    inbox, outbox = bus
    pool = FakePool(outbox, [APIError(400, "prompt too long", "prompt")])
    (ev,) = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
    assert isinstance(ev, APIError) and ev.status == 400 and ev.param == "prompt"
    assert not pool.calls[0].cancelled


async def test_error_after_some_deltas_ends_the_stream(bus):
    inbox, outbox = bus
    pool = FakePool(outbox, [delta(1), APIError(503, "engine unavailable", type="server_error", retry_after=5)])
    out = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
    assert isinstance(out[0], RouteInfo) and out[1].token_ids == (1,)
    assert isinstance(out[2], APIError) and out[2].status == 503 and out[2].headers == {"Retry-After": "5"}


async def test_timeout_is_408_and_cancels_the_pool_call(bus):
    inbox, outbox = bus
    pool = FakePool(outbox, [delta(i) for i in range(1, 100)], delay=0.05)
    evs = await collect(stream_plan(pool, plan(timeout_s=0.3), inbox))
    assert isinstance(evs[-1], APIError) and evs[-1].status == 408 and "0.3s" in evs[-1].message
    assert pool.calls[0].cancelled and inbox._queues == {}  # noqa: SLF001


async def test_queue_full_is_503_with_retry_after(bus):
    from ray.serve.exceptions import BackPressureError

    inbox, outbox = bus
    pool = FakePool(outbox, error=BackPressureError(num_queued_requests=5, max_queued_requests=5))
    (ev,) = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
    assert ev.status == 503 and ev.retry_after == 1 and ev.type == "overloaded"


async def test_early_exit_cancels_the_pool_call(bus):
    inbox, outbox = bus
    pool = FakePool(outbox, [delta(i) for i in range(1, 100)], delay=0.01)
    gen = stream_plan(pool, plan(), inbox)
    await collect(gen, n=3)
    await gen.aclose()  # what a disconnecting client does to the ingress's generator
    assert pool.calls[0].cancelled and inbox._queues == {}  # noqa: SLF001


async def test_a_request_id_already_streaming_is_refused_naming_request_id(bus):
    inbox, outbox = bus
    inbox.open("r1")  # another stream with the same id is running
    pool = FakePool(outbox, [delta(1, fin=True)])
    out = await collect(stream_plan(pool, plan(), inbox))
    assert len(out) == 1 and out[0].status == 400 and out[0].param == "request_id" and pool.calls == []


def test_api_error_survives_pickling_with_every_field():
    import pickle

    e = pickle.loads(pickle.dumps(APIError(429, "slow down", None, "rate_limit_exceeded", 3)))
    assert (e.status, e.message, e.param, e.type, e.retry_after) == (429, "slow down", None, "rate_limit_exceeded", 3)


def test_engine_errors_map_to_one_edge_type():
    from engine.errors import EngineDeadError, ProtectionCapError, PromptTooLongError, RequestAbortedError

    assert (lambda e: (e.status, e.param))(APIError.from_engine(PromptTooLongError(900, 511))) == (400, "prompt")
    assert APIError.from_engine(ProtectionCapError(600, 512)).param == "sinkserve.anchors"
    assert APIError.from_engine(RequestAbortedError("x")).status == 499
    dead = APIError.from_engine(EngineDeadError("boom"))
    assert dead.status == 503 and dead.retry_after == 5
    assert APIError.from_engine(KeyError("k")).status == 500


async def test_replica_lost_mid_stream_ends_it_with_a_503_naming_it(bus):
    """The replica (or its node) dies after some deltas: the client gets them, then one 503 that says
    so (an SSE error event before [DONE], app/http/ingress.py) -- never a 500, never a hang -- and the call is
    not sent again (the stream had started)."""
    from ray.exceptions import ActorDiedError

    inbox, outbox = bus

    class DiesAfterDeltas(FakePool):
        def remote(self, req):
            async def run():
                for i in (1, 2):
                    outbox.send(req.reply_to, req.request_id, delta(i))
                await outbox.drain(req.reply_to)
                await asyncio.sleep(0.05)
                raise ActorDiedError()

            call = FakeCall(req, outbox, (), 0.0, None)
            call.task.cancel()
            call.task = asyncio.ensure_future(run())
            self.calls.append(call)
            return call

    pool = DiesAfterDeltas(outbox)
    out = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox)), 10)
    assert isinstance(out[0], RouteInfo) and [t for d in out[1:-1] for t in d.token_ids] == [1, 2]
    err = out[-1]
    assert isinstance(err, APIError) and err.status == 503 and err.type == "unavailable" and err.retry_after == 1
    assert "lost the replica serving this request mid-stream" in err.message
    assert len(pool.calls) == 1 and inbox._queues == {}  # noqa: SLF001


class HeldCall(FakeCall):
    """A Serve call its router holds before any replica takes it (the pool's only replica was lost):
    ``_fetch_future_result_async`` -- Serve's assignment -- resolves only once ``assigned`` is set;
    the body runs after that."""

    def __init__(self, req, outbox, items, assigned: asyncio.Event):
        self.assigned = assigned
        super().__init__(req, outbox, items, 0.0, None)

    async def _run(self, outbox, items, delay, error):
        await self.assigned.wait()
        await super()._run(outbox, items, delay, error)

    async def _fetch_future_result_async(self):
        await self.assigned.wait()


class HeldPool(FakePool):
    def __init__(self, outbox, items=()):
        super().__init__(outbox, items)
        self.assigned = asyncio.Event()

    def remote(self, req):
        self.calls.append(HeldCall(req, self.outbox, self.items, self.assigned))
        return self.calls[-1]


async def test_a_call_no_replica_takes_while_the_pool_has_none_ready_is_a_503_naming_the_pool(bus):
    """Issue 40 item 2: the pool's only replica's node was lost; Serve would hold the call until a
    replacement runs (a minute). Once the hub sees no ready replica, the call is cancelled within
    replica_wait_s and the client gets a 503 with Retry-After naming the pool (failover's trigger)."""
    from app.pool.streaming import NO_REPLICA_RETRY_AFTER_S

    inbox, outbox = bus
    pool = HeldPool(outbox, [delta(1, fin=True)])
    ready = iter([True, False])  # the hub still lists the lost replica at the first deadline (its TTL)
    t0 = asyncio.get_running_loop().time()
    (ev,) = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox, replica_wait_s=0.1,
                                                       pool_ready=lambda: next(ready))), 5)
    took = asyncio.get_running_loop().time() - t0
    assert isinstance(ev, APIError) and ev.status == 503 and ev.type == "unavailable"
    assert "pool 'short' has no live replica" in ev.message and ev.retry_after == NO_REPLICA_RETRY_AFTER_S
    assert 0.2 <= took < 2.0  # two deadlines: the first found the pool still listed ready
    assert pool.calls[0].cancelled and inbox._queues == {}  # noqa: SLF001


async def test_a_call_queued_while_the_pool_is_ready_waits_for_its_replica(bus):
    """A busy pool (Serve queues the call; the hub sees the pool ready) is not refused at the deadline."""
    inbox, outbox = bus
    pool = HeldPool(outbox, [delta(1), delta(2, fin=True)])
    asyncio.get_running_loop().call_later(0.35, pool.assigned.set)  # after three deadlines
    out = await asyncio.wait_for(collect(stream_plan(pool, plan(), inbox, replica_wait_s=0.1,
                                                     pool_ready=lambda: True)), 5)
    assert isinstance(out[0], RouteInfo) and [t for d in out[1:] for t in d.token_ids] == [1, 2]
    assert not pool.calls[0].cancelled
