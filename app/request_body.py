"""The request-body limit: a body larger than ``max_body_bytes`` is refused with 413 before it is
parsed, whether it announces its size (``Content-Length``) or streams (chunked): the bytes are counted
as they arrive and reading stops at the limit. Without it one client's 20 MB body was read, parsed and
tokenized on the ingress's event loop while every other request waited."""

from __future__ import annotations

from typing import Any

from app.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than the limit of {limit} bytes (ingress.max_body_bytes)",
                    "body", "request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, at most ``limit`` bytes; else ``APIError`` 413 naming the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise APIError(400, f"Content-Length {declared!r} is not a number", "Content-Length") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
