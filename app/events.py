"""What flows back through the handles (pool -> router -> ingress): small frozen dataclasses.

A stream is ``RouteInfo`` first (so the ingress can set headers before any token), then
``TokenDelta`` items, the last with ``finished=True``; or a single ``ErrorEvent`` if the request is
refused, so HTTP statuses survive the hop without exception-wrapping through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouteInfo:
    request_id: str
    pool: str
    version: str
    deployment: str
    prompt_tokens: int


@dataclass(frozen=True)
class TokenDelta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens: tuple[str, ...] | None = None  # token strings, filled by the router when logprobs are asked


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str
    field: str | None = None
    retry_after: float | None = None
    type: str = "invalid_request_error"


@dataclass(frozen=True)
class PoolRequest:
    """What the router hands a pool: the prompt already tokenized, sampling as plain values."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: tuple[tuple[str, object], ...]
    anchors: tuple[object, ...] = ()
    timeout_s: float | None = None
    # The caller's token-bus inbox (host, port, secret): the deltas go there, one frame
    # per engine step, instead of one handle item each (app/token_bus.py). None: all on the handle.
    reply_to: tuple[str, int, bytes] | None = None


@dataclass(frozen=True)
class RoutePlan:
    """The router's decision: where the request goes and what the pool receives."""

    info: RouteInfo
    request: PoolRequest
