"""The token bus (engine/frontend/token_bus.py) and the ingress side of a bus stream (app.pool.streaming.bus_stream),
without Ray: a real TCP inbox and outbox on loopback in one event loop."""

from __future__ import annotations

import asyncio

import pytest

from app.errors import APIError
from app.events import TokenDelta
from app.pool.streaming import bus_stream
from engine.frontend.token_bus import TokenInbox, TokenOutbox


def delta(text: str, n: int, finished: bool = False) -> TokenDelta:
    return TokenDelta(text, (n,), None, finished, "length" if finished else None, 3, n)


async def take(q: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(q.get(), 5) for _ in range(n)]


def test_one_frame_per_loop_pass_and_each_request_gets_its_own_deltas_in_order():
    async def main():
        inbox, outbox = TokenInbox(), TokenOutbox()
        addr = await inbox.start("127.0.0.1")
        qa, qb = inbox.open("a"), inbox.open("b")
        # One engine step's deltas for two streams are sent in one pass: one frame.
        outbox.send(addr, "a", delta("x", 1))
        outbox.send(addr, "b", delta("y", 1))
        await outbox.drain(addr)
        assert [d.text for d in await take(qa, 1)] == ["x"]
        assert [d.text for d in await take(qb, 1)] == ["y"]
        assert (outbox.frames, outbox.deltas) == (1, 2)
        # The next step: another frame, order kept per request.
        outbox.send(addr, "a", delta("z", 2))
        outbox.send(addr, "a", delta("w", 3, finished=True))
        await outbox.drain(addr)
        got = await take(qa, 2)
        assert [d.text for d in got] == ["z", "w"] and got[-1].finished
        assert (outbox.frames, outbox.deltas) == (2, 4)
        assert inbox.frames == 2 and inbox.deltas == 4
        assert qb.empty()
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


def test_deltas_of_closed_or_unknown_requests_are_dropped():
    async def main():
        inbox, outbox = TokenInbox(), TokenOutbox()
        addr = await inbox.start("127.0.0.1")
        q = inbox.open("a")
        inbox.close("a")  # the client went away before the pool heard of it
        outbox.send(addr, "a", delta("late", 1))
        outbox.send(addr, "nobody", delta("stray", 1))
        await outbox.drain(addr)
        for _ in range(50):
            if inbox.deltas == 2:
                break
            await asyncio.sleep(0.01)
        assert inbox.deltas == 2 and q.empty()
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


def test_a_connection_without_the_secret_delivers_nothing():
    async def main():
        inbox = TokenInbox()
        host, port, secret = await inbox.start("127.0.0.1")
        q = inbox.open("a")
        outbox = TokenOutbox()
        outbox.send((host, port, b"x" * len(secret)), "a", delta("forged", 1))
        await outbox.drain((host, port, b"x" * len(secret)))
        await asyncio.sleep(0.2)
        assert q.empty() and inbox.frames == 0
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


def test_the_outbox_connects_again_after_the_inbox_side_dropped_it():
    async def main():
        inbox, outbox = TokenInbox(), TokenOutbox()
        addr = await inbox.start("127.0.0.1")
        q = inbox.open("a")
        outbox.send(addr, "a", delta("1", 1))
        await outbox.drain(addr)
        await take(q, 1)
        outbox._writers[addr].close()  # noqa: SLF001 - the connection breaks
        await asyncio.sleep(0.05)
        outbox.send(addr, "a", delta("2", 2))
        await outbox.drain(addr)
        assert [d.text for d in await take(q, 1)] == ["2"]
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


class FakeCall:
    """Stands in for a unary Serve call: returns once ``hold`` is set (at once without one), or raises ``error``."""

    def __init__(self, error: BaseException | None = None, hold: asyncio.Event | None = None):
        self.error, self.hold = error, hold

    async def _run(self):
        if self.hold is not None:
            await self.hold.wait()
        if self.error is not None:
            raise self.error

    def __await__(self):
        return self._run().__await__()


async def collect(it) -> list:
    return [x async for x in it]


def test_bus_stream_yields_the_deltas_from_the_queue_while_the_call_stays_open():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for d in (delta("a", 1), delta("b", 2), delta("c", 3, finished=True)):
            q.put_nowait(d)
        hold = asyncio.Event()  # the call is still open when the last delta arrives
        got = await asyncio.wait_for(collect(bus_stream(FakeCall(hold=hold), q)), 5)
        assert [d.text for d in got] == ["a", "b", "c"]

    asyncio.run(main())


def test_bus_stream_ends_on_an_error_after_some_deltas():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        err = APIError(503, "engine unavailable", type="server_error")
        q.put_nowait(delta("a", 1))
        q.put_nowait(err)
        q.put_nowait(delta("never", 2))
        it = bus_stream(FakeCall(hold=asyncio.Event()), q)
        assert (await asyncio.wait_for(it.__anext__(), 5)).text == "a"
        assert await asyncio.wait_for(it.__anext__(), 5) is err
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(it.__anext__(), 5)

    asyncio.run(main())


def test_bus_stream_waits_for_deltas_still_in_flight_when_the_call_ends():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        it = bus_stream(FakeCall(), q)
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.05)  # the call has ended; its frame is still on the way
        assert not first.done()
        q.put_nowait(delta("a", 1, finished=True))
        assert (await asyncio.wait_for(first, 5)).text == "a"

    asyncio.run(main())


def test_bus_stream_fails_when_the_call_ends_and_the_last_delta_never_comes():
    async def main():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(delta("a", 1))
        with pytest.raises(RuntimeError, match="last delta did not arrive"):
            await collect(bus_stream(FakeCall(), q, grace_s=0.2))

    asyncio.run(main())


def test_bus_stream_passes_on_a_failed_call():
    async def main():
        hold = asyncio.Event()
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(delta("a", 1))
        it = bus_stream(FakeCall(error=ConnectionError("replica died"), hold=hold), q)
        assert (await it.__anext__()).text == "a"
        hold.set()
        with pytest.raises(ConnectionError, match="replica died"):
            await asyncio.wait_for(it.__anext__(), 5)

    asyncio.run(main())


def test_the_outbox_forgets_connections_to_ingress_replicas_that_are_gone():
    async def main():
        inbox1, inbox2, outbox = TokenInbox(), TokenInbox(), TokenOutbox()
        addr1, addr2 = await inbox1.start("127.0.0.1"), await inbox2.start("127.0.0.1")
        q1, q2 = inbox1.open("a"), inbox2.open("b")
        outbox.send(addr1, "a", delta("1", 1))
        await outbox.drain(addr1)
        await take(q1, 1)
        assert outbox.connections == 1
        outbox._writers[addr1].close()  # noqa: SLF001 - that ingress replica went away
        outbox.send(addr2, "b", delta("2", 1))
        await outbox.drain(addr2)
        await take(q2, 1)
        assert outbox.connections == 1 and addr2 in outbox._writers  # noqa: SLF001
        await outbox.close()
        await inbox1.stop()
        await inbox2.stop()

    asyncio.run(main())


def test_a_request_id_already_streaming_is_refused():
    inbox = TokenInbox()
    inbox.open("a")
    with pytest.raises(ValueError, match="already in flight"):
        inbox.open("a")
    inbox.close("a")
    inbox.open("a")  # free again once the first stream ended


def test_silent_connections_are_dropped_and_pickled_frames_never_unpickled(monkeypatch):
    """A peer that never sends the secret is dropped after the handshake timeout; a peer with the
    secret that sends a pickle (which would run code if unpickled) loses its connection, and a
    well-formed frame after it on a new connection still arrives."""
    import pickle
    import struct

    import engine.frontend.token_bus as bus

    monkeypatch.setattr(bus, "HANDSHAKE_S", 0.2)

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    async def main():
        inbox, outbox = TokenInbox(error=APIError.from_stream_error), TokenOutbox()
        host, port, secret = await inbox.start("127.0.0.1")
        reader, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the inbox, no secret sent
        writer.close()
        reader, writer = await asyncio.open_connection(host, port)
        evil = pickle.dumps([("a", Boom())])
        writer.write(secret + struct.pack("!I", len(evil)) + evil)
        assert await asyncio.wait_for(reader.read(), 2) == b""  # malformed frame: connection dropped
        writer.close()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"x" * len(secret))  # the wrong secret
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        q = inbox.open("a")
        outbox.send((host, port, secret), "a",
                    APIError(429, "slow down", "tokens_per_minute", "quota_exceeded", 3).stream_error())
        await outbox.drain((host, port, secret))
        [err] = await take(q, 1)
        assert isinstance(err, APIError)  # the inbox's error factory made it
        assert (err.status, err.param, err.type, err.retry_after) == (429, "tokens_per_minute", "quota_exceeded", 3)
        assert inbox.frames == 1
        await outbox.close()
        await inbox.stop()

    asyncio.run(main())


def test_the_engine_process_writer_sends_one_frame_per_batch_from_its_thread_and_reconnects():
    """``ThreadOutbox`` (the engine process's writer): a batch is one frame, written by the lane's thread,
    errors too; a lane whose connection the ingress dropped connects again (the batch that met the broken
    socket is dropped: its stream ends through the Serve call); ``close`` writes what is queued first."""
    import struct

    from engine.errors import StreamError
    from engine.frontend.token_bus import ThreadOutbox, decode_frame

    async def main():
        inbox = TokenInbox()
        addr = await inbox.start("127.0.0.1")
        qa, qb = inbox.open("a"), inbox.open("b")
        out = ThreadOutbox()
        out.send(addr, [("a", delta("x", 1)), ("b", delta("y", 1))])
        assert [d.text for d in await take(qa, 1)] == ["x"] and [d.text for d in await take(qb, 1)] == ["y"]
        assert inbox.frames == 1 and (out.frames, out.deltas) == (1, 2)
        out.send(addr, [("a", StreamError(500, "boom", type="server_error"))])
        assert await take(qa, 1) == [StreamError(500, "boom", type="server_error")]
        out.close()
        await inbox.stop()

        # An ingress that drops every connection after one frame: the lane connects again.
        conns, frames = [], []

        async def once(reader, writer):
            conns.append(await reader.readexactly(16))
            (n,) = struct.unpack("!I", await reader.readexactly(4))
            frames.append(decode_frame(await reader.readexactly(n)))
            writer.close()

        server = await asyncio.start_server(once, "127.0.0.1", 0)
        lost = ("127.0.0.1", server.sockets[0].getsockname()[1], b"s" * 16)
        out = ThreadOutbox()
        for i in range(100):
            out.send(lost, [("a", delta(str(i), i))])
            await asyncio.sleep(0.02)
            if len(conns) >= 2 and len(frames) >= 2:
                break
        assert len(conns) >= 2 and conns[0] == b"s" * 16  # a new connection, opened with the secret again
        assert [f[0][1].text for f in frames[:2]][0] == "0"
        out.close()
        server.close()

    asyncio.run(main())
