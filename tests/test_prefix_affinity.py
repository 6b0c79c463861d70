"""Prefix affinity (app/pool/prefix_affinity.py, app/pool/affinity.py): requests without a session are ranked by a hash
of their leading KV blocks, with the pool's spill-over; a session id wins; the setting is validated."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.pool.affinity import SessionAffinityRouter, affinity_key, ranked
from app.builder import bucket_spec
from app.events import PoolRequest
from app.pool.prefix_affinity import prefix_key
from app.settings import PoolArgs, pool_limits
from engine import SamplingParams
from engine.config import DEFAULT_MODEL

SYSTEM = list(range(1000, 1100))  # a 100-token shared opening: 6 whole blocks of 16


def test_same_leading_blocks_same_key_whatever_the_tail() -> None:
    a = prefix_key(SYSTEM + [1, 2, 3, 4], 16, 64)
    assert a is not None and a == prefix_key(SYSTEM + [9] * 40, 16, 64)
    # the key covers exactly 64 tokens: a change at token 63 moves it, one at token 64 does not
    assert prefix_key(SYSTEM[:63] + [5] + SYSTEM[64:], 16, 64) != a
    assert prefix_key(SYSTEM[:64] + [5] + SYSTEM[65:], 16, 64) == a


def test_a_different_first_block_gives_a_different_key() -> None:
    assert prefix_key([7] + SYSTEM[1:], 16, 64) != prefix_key(SYSTEM, 16, 64)
    assert prefix_key(list(range(2000, 2100)), 16, 64) != prefix_key(SYSTEM, 16, 64)


def test_short_prompts_get_no_key_and_partial_windows_use_whole_blocks() -> None:
    assert prefix_key(SYSTEM[:15], 16, 64) is None  # less than one block: power of two choices
    assert prefix_key(SYSTEM, 16, None) is None  # the pool has prefix affinity off
    # 40 tokens = 2 whole blocks: the key covers 32 tokens, so token 32..39 do not change it
    assert prefix_key(SYSTEM[:40], 16, 64) == prefix_key(SYSTEM[:32] + [0] * 8, 16, 64)
    assert prefix_key(SYSTEM[:40], 16, 64) != prefix_key(SYSTEM[:64], 16, 64)


def test_the_key_follows_the_block_size() -> None:
    # window 64: with block 16 it covers 64 tokens; with block 64 the same; with block 128, a 100-token
    # prompt has no whole block
    assert prefix_key(SYSTEM, 16, 64) == prefix_key(SYSTEM, 64, 64)
    assert prefix_key(SYSTEM, 128, 128) is None
    # 48 tokens: three blocks of 16 (key over 48) but no whole block of 64
    assert prefix_key(SYSTEM[:48], 16, 64) is not None and prefix_key(SYSTEM[:48], 64, 64) is None
    # block 32, window 64, 40 tokens: one block (32 tokens), so tokens 32..39 do not count
    assert prefix_key(SYSTEM[:40], 32, 64) == prefix_key(SYSTEM[:32] + [0] * 8, 32, 64)


class Loads:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id.unique_id)


def choose(req: PoolRequest, max_load: int | None = None, loads: dict[str, int] | None = None,
           probed: dict[str, int] | None = None) -> list[str]:
    router = object.__new__(SessionAffinityRouter)
    router.max_load = max_load
    router._replica_queue_len_cache = Loads(loads or {})
    probes: list[int] = []

    async def probe(replicas, backoff_index):  # the replicas' own answer (default: what the cache says)
        probes.append(len(replicas))
        live = (loads or {}) if probed is None else probed
        return [(r, live.get(r.replica_id.unique_id)) for r in replicas]

    router._probe_queue_lens = probe
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("r1", "r2", "r3")]
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=(req,))))
    return [rank[0].replica_id.unique_id for rank in ranks]


def req(ids, session: str | None = None, window: int | None = 64) -> PoolRequest:
    return PoolRequest("q", tuple(ids), SamplingParams(), affinity=session, prefix_affinity=prefix_key(ids, 16, window))


def test_the_router_ranks_a_prefix_key_and_spills_over_at_max_load() -> None:
    key = prefix_key(SYSTEM, 16, 64)
    assert key == "prefix:" + key.removeprefix("prefix:") and len(key) == len("prefix:") + 32
    order = ranked(key, ["r1", "r2", "r3"])
    assert order == ["r1", "r3", "r2"]  # sha256 rendezvous, fixed by the key's definition
    assert choose(req(SYSTEM + [1, 2])) == order == choose(req(SYSTEM + [3] * 30))  # distinct tails, one replica
    assert choose(req(SYSTEM + [1]), 4, {"r1": 3}) == order  # below the threshold: stays
    assert choose(req(SYSTEM + [1]), 4, {"r1": 4, "r3": 2, "r2": 0}) == ["r2", "r1", "r3"]  # past it: least loaded


def test_distinct_prefixes_spread_and_a_session_wins_over_the_prefix() -> None:
    firsts = {choose(req([i] * 64))[0] for i in range(12)}
    assert firsts == {"r1", "r2", "r3"}  # twelve distinct openings use all three replicas
    prefix_order = choose(req(SYSTEM))
    session = next(s for s in (f"conv-{i}" for i in range(50)) if ranked(s, ["r1", "r2", "r3"])[0] != prefix_order[0])
    assert choose(req(SYSTEM, session=session)) == ranked(session, ["r1", "r2", "r3"])
    assert affinity_key(SimpleNamespace(args=(req(SYSTEM, session=session),))) == session
    assert affinity_key(SimpleNamespace(args=(req(SYSTEM[:10]),))) is None  # short: power of two choices


def test_the_setting_is_validated_and_reaches_the_planner_bucket() -> None:
    pool = PoolArgs(name="chat", affinity_max_load=8, prefix_affinity_tokens=256)
    bucket = bucket_spec(pool, [pool_limits(pool, DEFAULT_MODEL)], "p")
    assert (bucket.block_size, bucket.prefix_affinity_tokens) == (16, 256)
    assert bucket_spec(PoolArgs(name="x"), [pool_limits(pool, DEFAULT_MODEL)], "p").prefix_affinity_tokens is None
    assert PoolArgs(name="chat", affinity_max_load=8, prefix_affinity_tokens=128,
                    engine={"kv_cache_dtype": "int8"}).block_size == 64
    with pytest.raises(ValidationError, match="prefix_affinity_tokens: needs affinity_max_load"):
        PoolArgs(name="chat", prefix_affinity_tokens=256)
    with pytest.raises(ValidationError, match=r"prefix_affinity_tokens: must be a multiple .*block_size 64.*got 96"):
        PoolArgs(name="chat", affinity_max_load=8, prefix_affinity_tokens=96, engine={"kv_cache_dtype": "int8"})
    with pytest.raises(ValidationError, match="prefix_affinity_tokens"):
        PoolArgs(name="chat", affinity_max_load=8, prefix_affinity_tokens=0)
