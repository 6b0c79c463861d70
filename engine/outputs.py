"""What the engine hands back to callers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.errors import RequestAbortedError


@dataclass
class RequestOutput:
    """One streamed delta of a request (``finished`` marks the last one)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None  # delta: log p(prompt[i] | prompt[:i]) for new i >= 1
    # Per token of ``token_ids``: its ``top_logprobs`` alternatives ``(id, log-prob)``, best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class CompletionResult:
    """A whole finished request, as returned by ``LLMEngine.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)


async def next_delta(queue: asyncio.Queue[RequestOutput | BaseException], request_id: str) -> RequestOutput:
    """The next delta the engine loop put in a request's queue. Raises what the loop put there
    instead (engine dead, request refused), or ``RequestAbortedError`` when the engine aborted it."""
    item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    if item.finished and item.finish_reason == "abort":
        raise RequestAbortedError(f"request {request_id} was aborted")
    return item
