"""Session affinity: a conversation's turns go to the pool replica that holds its KV blocks.

Serve's request router for pool deployments. A request whose ``PoolRequest.affinity`` is set (the
session id) goes to the replica with the highest rendezvous score ``sha256(session | replica id)``;
every ingress replica computes the same ranking from the same replica set, so no state is shared
and nothing is stored. When that replica is full the next in the ranking takes the turn; when it
dies, Serve drops it from the set and the session moves to the next replica, where the turn is
re-prefilled from the token ids the store keeps (``app/state/conversations.py``). A request without a session
is ranked the same way by its prefix key when the pool sets ``prefix_affinity_tokens``: a hash of its
leading KV blocks, so requests sharing a system prompt or document meet its cached blocks
(``app/pool/prefix_affinity.py``: the key, and why a stateless hash rather than SGLang's per-replica radix
tree). A session id wins over a prefix key. Requests with neither (prefix affinity off, or a prompt
shorter than one block) use Serve's power-of-two-choices. Worked example (scores invented)::

    replicas   r1     r2     r3          session "c-42": r2 > r3 > r1  -> turns go to r2
    score      0.11   0.93   0.57        r2 dies: r3 > r1               -> r3 (re-prefill, then hits)
                                         sessions that ranked r1 / r3 first do not move

The same ranking for a prefix key ``prefix:9f2c...`` (requests A and B share a 150-token system prompt)::

    score      0.40   0.12   0.88        A -> r3 (prefills 190 tokens); B -> r3 (144 cached, prefills 31)

Past a load threshold (the pool's ``affinity_max_load``) a turn (or a prefix-keyed request) does not queue behind the replica that
holds its blocks: it goes to the least loaded replica instead, which restores the session's KV from the
session KV store (``engine/memory/session_cache.py``; without one it re-prefills)::

    max_load 4, loads r2 5, r3 1, r1 0   -> r1 first (r1 restores c-42's KV), then r2, r3 in rank order
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from app.pool import router_view  # by reference: Serve pickles this module by value (app/pool/router_view.py says why)

ROUTER_PATH = "app.pool.affinity:SessionAffinityRouter"


def score(key: str, replica: str) -> int:
    """Rendezvous score of ``replica`` for ``key`` (higher wins).

    >>> score("c-1", "a") == score("c-1", "a") and score("c-1", "a") != score("c-1", "b")
    True
    """
    return int.from_bytes(hashlib.sha256(f"{key}|{replica}".encode()).digest()[:8], "big")


def ranked(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` best first for ``key``; removing one never reorders the others.

    >>> r = ranked("c-42", ["r1", "r2", "r3"])
    >>> ranked("c-42", [x for x in r if x != r[0]]) == r[1:]
    True
    """
    return sorted(replicas, key=lambda rid: score(key, rid), reverse=True)


def affinity_order(ranking: Sequence[str], loads: dict[str, int | None], max_load: int | None) -> list[str]:
    """``ranking`` (best first) with the least loaded replica moved to the front when the first choice holds
    ``max_load`` requests or more and that one holds fewer (ties: the better ranked). Unknown loads (None)
    count as 0. The rest keep their rank order, so a refusal still falls back along the ranking.

    >>> affinity_order(["r2", "r3", "r1"], {"r2": 5, "r3": 1, "r1": 0}, 4)
    ['r1', 'r2', 'r3']
    >>> affinity_order(["r2", "r3", "r1"], {"r2": 3, "r3": 1, "r1": 0}, 4)   # below the threshold: stays
    ['r2', 'r3', 'r1']
    >>> affinity_order(["r2", "r3"], {"r2": 5, "r3": 6}, 4)   # everyone is busier: stays
    ['r2', 'r3']
    """
    order = list(ranking)
    if max_load is None or not order or (loads.get(order[0]) or 0) < max_load:
        return order
    best = min(order, key=lambda r: (loads.get(r) or 0, order.index(r)))
    if (loads.get(best) or 0) >= (loads.get(order[0]) or 0):
        return order
    return [best] + [r for r in order if r != best]


def affinity_key(pending: Any) -> str | None:
    """The key a pending Serve request is routed by (its first argument is a ``PoolRequest``): its
    session id, else its prefix key (``app/pool/prefix_affinity.py``), else None (power of two choices)."""
    args = getattr(pending, "args", None) or ()
    if not args:
        return None
    return getattr(args[0], "affinity", None) or getattr(args[0], "prefix_affinity", None)


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Rendezvous-hash routing for session turns and prefix-keyed requests, power of two choices for the rest."""

    max_load: int | None = None

    def initialize_state(self, max_load: int | None = None, **kwargs: Any) -> None:
        """Serve passes the deployment's ``request_router_kwargs`` (app/builder.py: the pool's affinity_max_load)."""
        super().initialize_state(**kwargs)
        self.max_load = max_load
        deployment = getattr(getattr(self, "_deployment_id", None), "name", None)
        if deployment:
            router_view.register(deployment, self)

    def _loads(self, replicas: Sequence[Any]) -> dict[str, int | None]:
        """Requests each replica held when last probed (Serve's queue-length cache; None: not known)."""
        cache = getattr(self, "_replica_queue_len_cache", None)
        return {r.replica_id.unique_id: cache.get(r.replica_id) if cache is not None else None for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        key = affinity_key(pending_request) if pending_request is not None else None
        if key is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = ranked(key, list(by_id))
        order = affinity_order(ranking, self._loads(candidate_replicas) if self.max_load else {}, self.max_load)
        if order[0] != ranking[0]:
            # Serve's cache counts every send but missed these calls' completions (measured: +1 per request,
            # so every replica read "full" after max_load requests and keys alternated between replicas;
            # docs/prefix_affinity.md). Leave the first choice only on loads just probed.
            probed = await self._probe_queue_lens(candidate_replicas, 0)
            order = affinity_order(ranking, {r.replica_id.unique_id: n for r, n in probed}, self.max_load)
        # One rank per replica: Serve tries the first; if it refuses (queue full) the next one.
        return [[by_id[rid]] for rid in order]
