"""Failover between pools (app/pool/failover.py), without a cluster: which pools can take a request, and
when a request moves (its pool down or unavailable before the first token), counted; when it does not
(overloaded, started, nowhere to go)."""

from __future__ import annotations

import asyncio

import pytest

from app.pool import failover
from app.errors import APIError
from app.events import PoolRequest, RouteInfo, RoutePlan, TokenDelta
from app.pool.failover import fallback_plans, stream_with_failover
from app.settings import BucketSpec
from engine.errors import EngineDeadError, EngineUnavailableError
from engine.sampling_params import SamplingParams

BUCKETS = (BucketSpec("short", 48, 60.0), BucketSpec("long", 400, 120.0, versions=("v1",)), BucketSpec("mid", 200, 60.0))
DEPLOYMENTS = ["pool-short-v1", "pool-short-v2", "pool-mid-v1", "pool-long-v1"]


def plan(pool: str, tokens: int, version: str = "v1") -> RoutePlan:
    info = RouteInfo("r1", pool, version, f"pool-{pool}-{version}", tokens)
    return RoutePlan(info, PoolRequest("r1", tuple(range(tokens)), SamplingParams(max_tokens=4)))


def test_fallbacks_are_the_other_pools_that_hold_the_prompt_smallest_first() -> None:
    assert [p.info.deployment for p in fallback_plans(plan("short", 30), BUCKETS, DEPLOYMENTS)] == ["pool-mid-v1", "pool-long-v1"]
    assert [p.info.pool for p in fallback_plans(plan("long", 300), BUCKETS, DEPLOYMENTS)] == []  # nothing else holds 300
    assert [p.info.pool for p in fallback_plans(plan("mid", 100), BUCKETS, DEPLOYMENTS)] == ["long"]
    assert fallback_plans(plan("short", 30, "v2"), BUCKETS, DEPLOYMENTS) == []  # v2 is served by short only
    moved = fallback_plans(plan("short", 30), BUCKETS, DEPLOYMENTS)[0]
    assert moved.request == plan("short", 30).request  # the same tokens and sampling, another pool


def test_a_moved_request_carries_the_prefix_key_of_the_pool_it_moves_to() -> None:
    """short hashes its first 32 tokens (two 16-token blocks), mid its first 128 (two 64-token blocks); long
    has no prefix affinity. A session's key goes unchanged."""
    from dataclasses import replace

    from app.pool.prefix_affinity import prefix_key

    buckets = (BucketSpec("short", 200, 60.0, prefix_affinity_tokens=32),
               BucketSpec("mid", 300, 60.0, block_size=64, prefix_affinity_tokens=128),
               BucketSpec("long", 400, 120.0))
    ids = tuple(range(150))
    p = plan("short", 150)
    p = replace(p, request=replace(p.request, prefix_affinity=prefix_key(ids, 16, 32)))
    mid, long = fallback_plans(p, buckets, DEPLOYMENTS)
    assert (mid.info.pool, long.info.pool) == ("mid", "long")
    assert mid.request.prefix_affinity == prefix_key(ids, 64, 128) != p.request.prefix_affinity
    assert prefix_key(ids[:128] + (7,) * 22, 64, 128) == mid.request.prefix_affinity  # tokens past 128 do not count
    assert long.request.prefix_affinity is None
    assert replace(mid.request, prefix_affinity=None) == replace(p.request, prefix_affinity=None)
    session = replace(p, request=replace(p.request, affinity="conv-1"))
    assert {f.request.prefix_affinity for f in fallback_plans(session, buckets, DEPLOYMENTS)} == {p.request.prefix_affinity}


def delta(text: str) -> TokenDelta:
    return TokenDelta(text, (1,), None, True, "stop", 3, 1)


def run(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list], p: RoutePlan, ready=lambda d: True):
    """Drive stream_with_failover over fake pools: ``answers[deployment]`` is what that pool yields."""
    calls: list[str] = []
    moves: list[tuple[str, str, str]] = []

    async def fake_stream_plan(pool, plan, inbox, **_):
        calls.append(plan.info.deployment)
        for ev in answers[plan.info.deployment]:
            yield plan.info if ev == "info" else ev

    monkeypatch.setattr(failover, "stream_plan", fake_stream_plan)

    async def main():
        fbs = fallback_plans(p, BUCKETS, DEPLOYMENTS)
        return [ev async for ev in stream_with_failover(p, fbs, {d: None for d in DEPLOYMENTS}, None, ready,
                                                        lambda *a: moves.append(a))]

    return asyncio.run(main()), calls, moves


DOWN = APIError(503, "engine unavailable: engine process exited with code -9", type="unavailable", retry_after=5)


def test_a_request_whose_pool_answers_unavailable_goes_to_the_next_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    evs, calls, moves = run(monkeypatch, {"pool-short-v1": [DOWN], "pool-mid-v1": ["info", delta("ok")]}, plan("short", 30))
    assert calls == ["pool-short-v1", "pool-mid-v1"]
    assert isinstance(evs[0], RouteInfo) and evs[0].pool == "mid" and evs[1].text == "ok"
    assert moves == [("short", "mid", "unavailable")]


def test_a_pool_known_down_is_skipped_and_an_overloaded_one_is_not_failed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    evs, calls, moves = run(monkeypatch, {"pool-mid-v1": ["info", delta("ok")]}, plan("short", 30),
                            ready=lambda d: d != "pool-short-v1")
    assert calls == ["pool-mid-v1"] and moves == [("short", "mid", "not_ready")]
    busy = APIError(503, "pool 'short' is at capacity; retry later", type="overloaded", retry_after=1)
    evs, calls, moves = run(monkeypatch, {"pool-short-v1": [busy]}, plan("short", 30))
    assert evs == [busy] and calls == ["pool-short-v1"] and moves == []
    # A request that was in the engine when it died is not moved: it may be what killed it.
    died = APIError.from_engine(EngineDeadError("engine hung: no step for 3.1s"))
    evs, calls, moves = run(monkeypatch, {"pool-short-v1": [died]}, plan("short", 30))
    assert evs == [died] and died.status == 503 and moves == []
    assert APIError.from_engine(EngineUnavailableError("engine process exited")).type == "unavailable"


def test_with_nowhere_to_go_the_client_gets_503_with_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    evs, calls, moves = run(monkeypatch, {"pool-long-v1": [DOWN]}, plan("long", 300))
    assert evs == [DOWN] and DOWN.headers == {"Retry-After": "5"} and moves == []
    every = {d: [DOWN] for d in DEPLOYMENTS}
    evs, calls, moves = run(monkeypatch, every, plan("short", 30))
    assert evs == [DOWN] and calls == ["pool-short-v1", "pool-mid-v1", "pool-long-v1"]
    assert moves == [("short", "mid", "unavailable"), ("mid", "long", "unavailable")]


def test_a_stream_that_started_is_never_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    evs, calls, moves = run(monkeypatch, {"pool-short-v1": ["info", TokenDelta("a", (1,), None, False, None, 3, 1), DOWN]},
                            plan("short", 30))
    assert calls == ["pool-short-v1"] and evs[-1] is DOWN and moves == []


def test_failovers_are_counted_in_the_metrics() -> None:
    from app.metrics import RequestMetrics, render

    rm = RequestMetrics()
    rm.failover("short", "long", "unavailable")
    rm.failover("short", "long", "unavailable")
    text = render({"ingress/a": {"kind": "ingress", "replica": "a", "data": rm.snapshot()}}).decode()
    assert 'sinkserve_failover_total{from_pool="short",reason="unavailable",replica="a",to_pool="long"} 2.0' in text
