"""Server-sent events framing (OpenAI style: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"


class SettledStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that awaits ``on_exit`` however its ``__call__`` ends.

    Why: a client that leaves after the handler returned, before the body started (sending the headers
    fails -- uvicorn's ``ClientDisconnected`` -- or the server reports the disconnect first and
    Starlette cancels the response), ends the response without ever running its body iterator. An
    async generator that never started never runs its ``finally``: what it would have released (a
    conversation's turn lock, the pool call, the tenant's reservation) stayed held. ``on_exit`` does
    that release when the body never started (it is told nothing else: it checks for itself)."""

    def __init__(self, content: AsyncIterator[bytes], on_exit: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_exit = on_exit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_exit()
