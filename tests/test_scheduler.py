"""Scheduler: budgets, decode priority, admission by free blocks, preemption, eviction. No torch."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.retention import blocks_of
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 11, block_size: int = 4, budget: int = 8, max_seqs: int = 8, policy: CachePolicy | None = None):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, policy or CachePolicy(), max_seqs, budget)


def run_step(sched: Scheduler, out: SchedulerOutput, sample_token: int = 7) -> None:
    """What the engine does after a forward: the scheduler's own post-step update, one token each."""
    sched.update_after_step(out, [sample_token] * sum(1 for item in out.scheduled if item.samples))


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    bm, sched = make(budget=8)
    a = Sequence("a", [1, 2, 3], SamplingParams(), arrival=0)
    sched.add(a)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 3)]
    run_step(sched, out)
    long = Sequence("long", list(range(20)), SamplingParams(), arrival=1)
    sched.add(long)
    for expected_chunk in (7, 7, 6):
        out = sched.schedule()
        # the decode of "a" is always first and always present
        assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("long", expected_chunk)]
        run_step(sched, out)
    assert long.num_output_tokens == 1
    bm.check_integrity(sched.live_sequences())


def test_admission_waits_for_free_blocks() -> None:
    bm, sched = make(num_blocks=4, block_size=4, budget=64)  # 3 usable blocks
    a = Sequence("a", list(range(9)), SamplingParams(), arrival=0)  # 3 blocks
    b = Sequence("b", list(range(50, 53)), SamplingParams(), arrival=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert b.status is SequenceStatus.WAITING
    sched.finish(a, "stop")
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b"]
    assert b.block_table == [3]
    bm.check_integrity(sched.live_sequences())


def test_preemption_frees_latest_arrival_and_requeues_it_first() -> None:
    bm, sched = make(num_blocks=4, block_size=2, budget=64)  # 3 usable blocks
    a = Sequence("a", [1, 2], SamplingParams(), arrival=0)
    b = Sequence("b", [3, 4], SamplingParams(), arrival=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    run_step(sched, out)  # a: [1,2,7], b: [3,4,7], each holds 1 block, both need a 2nd
    assert a.block_table == [1] and b.block_table == [2]
    out = sched.schedule()
    # a takes the last free block; b then needs one and is preempted
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(sched.waiting) == [b]
    assert a.block_table == [1, 3]
    bm.check_integrity(sched.live_sequences())


def test_sliding_window_evicts_unprotected_blocks_and_rotates_sinks() -> None:
    policy = CachePolicy(eviction_policy="sliding_window", window=4, protected_positions=(0,))
    bm, sched = make(num_blocks=11, block_size=2, budget=2, policy=policy)
    s = Sequence("s", list(range(12)), SamplingParams(), arrival=0, protected_positions=[0])
    s.protected_blocks = blocks_of([0], 2)
    sched.add(s)
    records, rotations = [], []
    while s.num_output_tokens == 0:
        out = sched.schedule()
        records += out.evictions
        rotations += out.rotations
        run_step(sched, out)
    # 12 prompt tokens in chunks of 2; before the last chunk 10 are computed: window = tokens 6..9
    # logical blocks 1, 2 evicted; the sink block 1 was hashed in the prefix cache, so before its keys
    # were rotated it was copied to private block 5 (block 1 stays cached, in the free queue)
    assert s.block_table == [5, 0, 0, 4, 6, 7]
    assert [r.evicted_ranges for r in records] == [((2, 4),), ((4, 6),)]
    assert [r.freed_blocks for r in records] == [(2,), (3,)]
    assert all(r.request_id == "s" and r.window == 4 for r in records)
    # the sink moves forward 2 positions per evicted block
    assert rotations == [(5, 2), (5, 2)]
    assert bm.match_prefix([0, 1, 99]) == [1]
    assert sched.tokens_evicted == 4
    bm.check_integrity(sched.live_sequences())


def test_update_after_step_advances_commits_and_appends_in_schedule_order() -> None:
    bm, sched = make(num_blocks=11, block_size=4, budget=9)
    a = Sequence("a", [1, 2, 3], SamplingParams(), arrival=0)
    sched.add(a)
    sched.update_after_step(sched.schedule(), [40])  # a's prefill samples 40
    b = Sequence("b", list(range(20)), SamplingParams(), arrival=1)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]
    assert sched.update_after_step(out, [41]) == [a]  # b's chunk does not reach its end: no token
    assert a.token_ids == [1, 2, 3, 40, 41] and a.num_computed_tokens == 4
    assert b.token_ids == list(range(20)) and b.num_computed_tokens == 8
    # a's first block (4 tokens) and b's first two are full, so the prefix cache may hand them out
    assert sorted(bm.hash_to_block.values()) == sorted([a.block_table[0], *b.block_table[:2]])
    import pytest

    with pytest.raises(ValueError, match="1 sequences sample this step, got 2 tokens"):
        sched.update_after_step(sched.schedule(), [1, 2])


def test_a_quantized_cache_admits_a_cached_prefix_longer_than_its_side_pool() -> None:
    """Packed prefix hits need no 16-bit slot: 10 cached packed blocks and a 3-slot side pool admit the
    request on its 10 hits (counting them against the side pool left it waiting forever)."""
    bm = BlockManager(num_blocks=20, block_size=4, num_fp_blocks=3)
    first = Sequence("first", list(range(41)), SamplingParams(max_tokens=1))
    sched = Scheduler(bm, CachePolicy(eviction_policy="none", residual_window=0, keep_protected_16bit=False), 4, 8)
    sched.add(first)
    while first.num_computed_tokens < 41:  # 8 tokens a step; full blocks are packed at the next step
        run_step(sched, sched.schedule())
    sched.schedule()  # packs the last full blocks
    cached = list(first.block_table[:10])
    assert not any(bm.is_fp(b) for b in cached)
    sched.finish(first, "stop")
    bm.take_kv_ops()
    second = Sequence("second", list(range(41)) + [99], SamplingParams(max_tokens=1))
    sched.add(second)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("second", 2)]
    assert second.block_table[:10] == cached and second.num_cached_tokens == 40
    bm.check_integrity([second])
