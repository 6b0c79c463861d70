"""Bounded work at the ingress: the body limit (413 naming it, before parsing, with or without a
Content-Length) and the planning pool (off the event loop, bounded, 503 when saturated)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.errors import APIError
from app.plan.plan_pool import PlanPool
from app.http.request_body import read_body


class FakeRequest:
    def __init__(self, chunks: list[bytes], content_length: int | None) -> None:
        self.headers = {} if content_length is None else {"content-length": str(content_length)}
        self.chunks = chunks
        self.read = 0

    async def stream(self):
        for c in self.chunks:
            self.read += len(c)
            yield c


def test_a_body_over_the_limit_is_refused_with_413_naming_it() -> None:
    big = FakeRequest([b"x" * 1024] * 20, content_length=20 * 1024)
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(big, 4096))
    assert e.value.status == 413 and "4096 bytes" in e.value.message and "max_body_bytes" in e.value.message
    assert big.read == 4 * 4096 + 1024  # drained (and dropped) up to 4x the limit, then cut
    small_over = FakeRequest([b"x" * 1024] * 5, content_length=5 * 1024)
    with pytest.raises(APIError):
        asyncio.run(read_body(small_over, 4096))
    assert small_over.read == 5 * 1024  # read to its end, so the client gets the 413, not a reset
    chunked = FakeRequest([b"x" * 1024] * 20, content_length=None)  # no Content-Length: counted as it arrives
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(chunked, 4096))
    assert e.value.status == 413 and chunked.read == 4 * 4096 + 1024
    ok = FakeRequest([b'{"a":', b" 1}"], content_length=None)
    assert asyncio.run(read_body(ok, 4096)) == b'{"a": 1}'
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(_bad_length(), 4096))
    assert e.value.status == 400 and e.value.param == "Content-Length"


def _bad_length() -> FakeRequest:
    r = FakeRequest([b"{}"], None)
    r.headers = {"content-length": "lots"}
    return r


def test_planning_runs_off_the_event_loop_and_the_loop_keeps_ticking() -> None:
    pool = PlanPool(threads=1, max_waiting=0)
    ticked = threading.Event()

    def busy() -> int:  # pure-Python CPU work (like BM25 over many passages) until the loop has ticked
        n = 0
        while not ticked.is_set() and n < 50_000_000:  # bounded: on the loop it could never see a tick
            n += 1
        return threading.get_ident()

    async def main():
        ticks = 0
        task = asyncio.ensure_future(pool.run(busy))
        while not task.done():
            ticks += 1
            if ticks == 5:
                ticked.set()  # the loop ran 5 times while the plan was busy
            await asyncio.sleep(0.001)
        return await task, ticks

    ident, ticks = asyncio.run(main())
    assert ident != threading.get_ident()
    assert ticked.is_set() and ticks >= 5  # progress, not timing: the loop served others meanwhile
    pool.shutdown()


def test_a_saturated_plan_pool_refuses_with_503_and_retry_after() -> None:
    pool = PlanPool(threads=1, max_waiting=1)
    gate = threading.Event()

    async def main():
        a = asyncio.ensure_future(pool.run(gate.wait, 5))
        b = asyncio.ensure_future(pool.run(gate.wait, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await pool.run(lambda: None)
        gate.set()
        await asyncio.gather(a, b)
        assert await pool.run(lambda: 7) == 7  # room again
        return e.value

    err = asyncio.run(main())
    assert err.status == 503 and err.headers == {"Retry-After": "1"}
    pool.shutdown()


def test_an_error_raised_while_planning_reaches_the_caller() -> None:
    pool = PlanPool()

    def refuse():
        raise APIError(400, "bad field", "prompt")

    with pytest.raises(APIError, match="bad field"):
        asyncio.run(pool.run(refuse))
    pool.shutdown()
