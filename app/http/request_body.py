"""The request-body limit: a body larger than ``max_body_bytes`` is refused with 413 before it is
parsed, whether it announces its size (``Content-Length``) or streams (chunked): the bytes are counted
as they arrive, and past the limit they are dropped, never kept or parsed. Without it one client's 20 MB body was read, parsed and
tokenized on the ingress's event loop while every other request waited."""

from __future__ import annotations

from typing import Any

from app.errors import APIError

DRAIN_FACTOR = 4  # an oversized body is read and dropped up to this many times the limit (then cut)


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes (ingress.max_body_bytes)",
                    "body", "request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, at most ``limit`` bytes; else ``APIError`` 413 naming the limit.

    An oversized body is read to its end and dropped (kept nowhere, parsed never) up to ``DRAIN_FACTOR``
    times the limit, so an HTTP/1.1 client still sending it gets the 413 rather than a connection reset."""
    declared = request.headers.get("content-length")
    over = False
    if declared is not None:
        try:
            over = int(declared) > limit
        except ValueError:
            raise APIError(400, f"Content-Length {declared!r} is not a number", "Content-Length") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if over or size > limit:
            over = True
            chunks.clear()
            if size > DRAIN_FACTOR * limit:
                break
            continue
        chunks.append(chunk)
    if over:
        raise too_large(limit)
    return b"".join(chunks)
