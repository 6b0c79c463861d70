"""The typed messages of the request path (frozen dataclasses; pickled across processes).

::

    ingress --PoolRequest (Serve call)--> pool replica --AddRequest (pipe)--> engine process
    ingress <==TokenDelta ... | StreamError==================================== engine process
                                                   (token bus: one return channel, one crossing)

A handle caller of ``Ingress.generate`` receives ``RouteInfo`` first (so headers can be set before
any token), then ``TokenDelta`` items, the last with ``finished=True``; or one ``APIError``
(``app/errors.py``), before or after some deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import TokenDelta  # the one streamed delta type, made by the engine's front
from engine.sampling_params import SamplingParams

__all__ = ["PassageReport", "PassageScore", "PoolRequest", "RouteInfo", "RoutePlan", "TokenDelta"]


@dataclass(frozen=True)
class PassageScore:
    id: str
    score: float
    tokens: int  # the passage tokenized alone (no special tokens): what the budget counts


@dataclass(frozen=True)
class PassageReport:
    """What the planner did with ``sinkserve.passages`` (``app/plan/passages.py``): kept and dropped."""

    scorer: str
    budget: int | None
    kept: tuple[PassageScore, ...]
    dropped: tuple[PassageScore, ...]
    pinned: bool = False

    @property
    def tokens_kept(self) -> int:
        return sum(p.tokens for p in self.kept)

    @property
    def tokens_saved(self) -> int:
        return sum(p.tokens for p in self.dropped)


@dataclass(frozen=True)
class RouteInfo:
    request_id: str
    pool: str
    version: str
    deployment: str
    prompt_tokens: int
    passages: PassageReport | None = None  # only for requests that sent passages
    conversation: str | None = None  # a conversation turn (app/state/conversations.py)
    new_tokens: int | None = None  # of prompt_tokens, what this turn's message added
    policy_version: str | None = None  # the pool's cache policy version (a conversation records it)


@dataclass(frozen=True)
class PoolRequest:
    """What the planner hands a pool: the prompt already tokenized, sampling already validated,
    anchors already resolved to token ranges ``(start, end)`` of the prompt."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    anchors: tuple[tuple[int, int], ...] = ()
    timeout_s: float | None = None
    soft_timeout_s: float | None = None  # the ingress ends the stream cleanly here (app/pool/streaming.py)
    # The caller's token-bus inbox (host, port, secret): every delta and any error go there,
    # one frame per engine message, written where the engine steps (engine/frontend/token_bus.py).
    reply_to: tuple[str, int, bytes] | None = None
    # A session's id: the pool's router sends every turn of a session to the same replica
    # (app/pool/affinity.py), where its earlier turns' blocks sit in the prefix cache.
    affinity: str | None = None
    # A request without a session: the hash of its leading KV blocks (app/pool/prefix_affinity.py). The router
    # ranks replicas by it the same way, so requests sharing a long prefix meet that prefix's cached
    # blocks; ``affinity``, when set, wins.
    prefix_affinity: str | None = None


@dataclass(frozen=True)
class RoutePlan:
    """The planner's decision: where the request goes and what the pool receives."""

    info: RouteInfo
    request: PoolRequest
