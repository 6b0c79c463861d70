"""Scheduler: budgets, decode priority, admission by free blocks, preemption, eviction. No torch."""

from __future__ import annotations

from engine.memory.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.memory.retention import blocks_of
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
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


def test_eviction_waits_when_a_shared_sink_has_no_block_for_its_copy() -> None:
    """Two requests share the sink block 1 and block 2 (a prefix hit); the pool is full. When ``a``'s
    window passes block 2, evicting it frees nothing (``b`` still reads it) and rotating the sink needs a
    copy: the eviction waits a step instead of raising, ``a``'s growth preempts ``b``, and the eviction
    then runs on private blocks."""
    policy = CachePolicy(eviction_policy="sliding_window", window=4, protected_positions=(0,))
    bm, sched = make(num_blocks=6, block_size=2, budget=64, policy=policy)  # 5 usable blocks
    a = Sequence("a", [10, 11, 12, 13, 14, 15], SamplingParams(), arrival=0, protected_positions=[0])
    b = Sequence("b", [10, 11, 12, 13, 14, 15, 20], SamplingParams(), arrival=1, protected_positions=[0])
    a.protected_blocks = b.protected_blocks = blocks_of([0], 2)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())
    assert a.block_table == [1, 2, 3, 4] and b.block_table == [1, 2, 3, 5] and bm.num_allocatable == 0
    out = sched.schedule()  # a holds 8 tokens: block 1 (logical) left its 4-token window
    assert out.evictions == [] and out.rotations == [] and sched.evictions_deferred == 1
    assert out.preempted == [b] and a.block_table == [1, 2, 3, 4, 5]
    run_step(sched, out)
    out = sched.schedule()
    # block 2 is a's alone now: evicted (it stays in the prefix cache); the sink is copied into it
    # before its keys rotate, since block 1 is still hashed
    assert [r.freed_blocks for r in out.evictions] == [(2,)]
    assert out.copies == [(1, 2)] and out.rotations == [(2, 2)]
    assert a.block_table == [2, 0, 3, 4, 5]
    bm.check_integrity(sched.live_sequences())


def test_random_shared_prefix_workloads_under_pool_pressure_never_fail_or_leak() -> None:
    """Requests sharing prefixes, small pools, sliding-window or importance eviction, dense or quantized
    bookkeeping: every step schedules without raising and the books balance (before the copy-on-write
    check, about one seed in ten raised "no free block to copy shared block")."""
    import random

    for seed in range(300):
        rng = random.Random(seed)
        bs = rng.choice([2, 4])
        importance = rng.random() < 0.3
        protected = tuple(sorted(rng.sample(range(6), rng.randint(1, 2))))
        policy = CachePolicy(eviction_policy="importance" if importance else "sliding_window", window=bs * rng.randint(1, 3),
                             protected_positions=protected, block_budget=rng.randint(3, 5), residual_window=bs * rng.randint(0, 2))
        num_blocks = rng.randint(6, 16)
        bm = BlockManager(num_blocks, bs, num_fp_blocks=rng.randint(4, num_blocks) if rng.random() < 0.4 else None)
        sched = Scheduler(bm, policy, rng.randint(2, 6), rng.choice([4, 8, 16, 64]))
        prefixes = [[rng.randrange(100) for _ in range(rng.randint(1, 12))] for _ in range(2)]
        live: dict[str, Sequence] = {}
        for step in range(60):
            if rng.random() < 0.4:
                tokens = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randint(0, 6))]
                s = Sequence(f"s{step}", tokens, SamplingParams(max_tokens=rng.randint(1, 20)), arrival=step,
                             protected_positions=list(protected))
                s.protected_blocks = blocks_of(list(protected), bs)
                sched.add(s)
                live[s.request_id] = s
            out = sched.schedule()
            if importance:  # the runner's attention scores, stand-ins
                for item in out.scheduled:
                    scores = item.seq.block_importance
                    scores.extend([0.0] * (len(item.seq.block_table) - len(scores)))
                    for k in range(len(scores)):
                        scores[k] += rng.random()
            sched.update_after_step(out, [rng.randrange(100) for item in out.scheduled if item.samples])
            for s in list(live.values()):
                if s.status is SequenceStatus.RUNNING and s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
                    del live[s.request_id]
            bm.check_integrity(sched.live_sequences())


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
