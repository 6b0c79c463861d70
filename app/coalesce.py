"""Adaptive coalescing of a token stream: when the consumer falls behind, the deltas that piled up
are merged into one message instead of crossing the next hop one by one.

Under light load every token still goes out alone (no added latency); under heavy load the number of
messages per hop drops to what the consumer can take, which is what keeps inter-token latency flat
when a few CPU cores serve many streams (every hop costs serialization and a syscall per message).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import AsyncIterator, TypeVar

from app.events import TokenDelta

T = TypeVar("T")
_END = object()
_TIMEOUT = object()


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """``a`` then ``b`` as one delta: texts, ids, logprobs and token strings concatenated; the
    finish state and counters are ``b``'s (counters are cumulative).

    >>> a = TokenDelta("he", (1,), None, False, None, 3, 1)
    >>> b = TokenDelta("llo", (2,), None, True, "length", 3, 2)
    >>> m = merge_deltas(a, b); (m.text, m.token_ids, m.finished, m.completion_tokens)
    ('hello', (1, 2), True, 2)
    """
    lp = None if a.logprobs is None and b.logprobs is None else (a.logprobs or ()) + (b.logprobs or ())
    toks = None if a.tokens is None and b.tokens is None else (a.tokens or ()) + (b.tokens or ())
    return replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=lp, tokens=toks)


async def pump_into(source: AsyncIterator[T], queue: asyncio.Queue, end: object) -> None:
    """Put every item of ``source`` into ``queue``, then ``end``; an error goes into the queue
    too, for the consumer to raise (run as a task; cancelling it closes ``source``)."""
    try:
        async for item in source:
            queue.put_nowait(item)
        queue.put_nowait(end)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - the consumer raises it
        queue.put_nowait(e)


async def coalesced(source: AsyncIterator[T], timeout_s: float | None = None) -> AsyncIterator[T]:
    """Yield from ``source``, merging consecutive unfinished ``TokenDelta``s that are already waiting.

    ``source`` is pumped by a task; closing or cancelling this generator cancels that task, which
    closes ``source`` (so an abort still reaches the engine at once). With ``timeout_s``, the whole
    stream must end in time or ``asyncio.TimeoutError`` is raised: one timer per stream, not a
    ``wait_for`` task per token.
    """
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    timer = loop.call_later(timeout_s, queue.put_nowait, _TIMEOUT) if timeout_s is not None else None

    task = loop.create_task(pump_into(source, queue, _END))
    try:
        while True:
            item = await queue.get()
            while (
                isinstance(item, TokenDelta)
                and not item.finished
                and not queue.empty()
                and isinstance(queue._queue[0], TokenDelta)  # noqa: SLF001 - peek, single consumer
            ):
                item = merge_deltas(item, queue.get_nowait())
            if item is _END:
                return
            if item is _TIMEOUT:
                raise asyncio.TimeoutError(f"stream did not finish within {timeout_s}s")
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, TokenDelta) and item.finished:
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
