"""What the engine hands back to callers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Sequence as Seq

from engine.errors import RequestAbortedError, RequestFailedError
from engine.isolation import ERROR_FINISH


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
    # Why the request failed inside the engine (``finish_reason == "error"``, engine/isolation.py).
    error: str | None = None


def concat_optional(a: Seq | None, b: Seq | None) -> Seq | None:
    """``a + b`` where either may be absent (None): None only when both are. Lists or tuples; merging two
    deltas (here and in ``app.pool.streaming``) concatenates their optional per-token fields with it."""
    if a is None:
        return b
    return a if b is None else a + b


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One delta equal to ``first`` followed by ``then`` (two consecutive deltas of one request): the
    lists and the text concatenated, the counts and the finish from ``then``. A reader that fell behind
    takes what is ready as one delta instead of one per step.

    >>> a = RequestOutput("r", "Hel", [1], [-0.5], False, None, 3, 1)
    >>> b = RequestOutput("r", "lo", [2], [-0.25], True, "length", 3, 2)
    >>> m = merge_deltas(a, b)
    >>> (m.text, m.token_ids, m.logprobs, m.finished, m.finish_reason, m.completion_tokens)
    ('Hello', [1, 2], [-0.5, -0.25], True, 'length', 2)
    """
    return RequestOutput(
        request_id=then.request_id,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=concat_optional(first.logprobs, then.logprobs),
        finished=then.finished,
        finish_reason=then.finish_reason,
        prompt_tokens=then.prompt_tokens,
        completion_tokens=then.completion_tokens,
        cached_tokens=then.cached_tokens,
        prompt_logprobs=concat_optional(first.prompt_logprobs, then.prompt_logprobs),
        top_logprobs=concat_optional(first.top_logprobs, then.top_logprobs),
        error=then.error,
    )


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
    instead (engine dead, request refused), ``RequestAbortedError`` when the engine aborted it, or
    ``RequestFailedError`` when this request alone failed inside the engine."""
    item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    if item.finished and item.finish_reason == "abort":
        raise RequestAbortedError(f"request {request_id} was aborted")
    if item.finished and item.finish_reason == ERROR_FINISH:
        raise RequestFailedError(request_id, item.error or "unknown error")
    return item
