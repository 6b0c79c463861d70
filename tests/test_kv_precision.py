"""Quantized KV bookkeeping: which blocks are 16-bit, when a block is packed, what the runner is told.
Pure Python with exact block ids (the torch side is tests/test_kv_quant_engine.py)."""

from __future__ import annotations

import pytest

from engine.memory.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.memory.retention import blocks_of
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def make(num_blocks: int = 11, num_fp: int = 6, block_size: int = 4, budget: int = 64,
         policy: CachePolicy | None = None) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(num_blocks, block_size, num_fp_blocks=num_fp)
    return bm, Scheduler(bm, policy or CachePolicy(residual_window=4, protected_positions=(0,)), 8, budget)


def seq(rid: str, n: int, protected: tuple[int, ...] = (0,), block_size: int = 4, arrival: int = 0) -> Sequence:
    s = Sequence(rid, list(range(100, 100 + n)), SamplingParams(), arrival=arrival, protected_positions=list(protected))
    s.protected_blocks = blocks_of(protected, block_size)
    return s


def step(sched: Scheduler, out: SchedulerOutput) -> None:
    sched.update_after_step(out, [7] * sum(1 for item in out.scheduled if item.samples))


def test_new_blocks_take_slots_and_pack_once_after_the_residual_window() -> None:
    bm, sched = make()
    s = seq("s", 18)
    sched.add(s)
    out = sched.schedule()
    assert s.block_table == [1, 2, 3, 4, 5]
    assert out.kv_ops == [("assign", 1, 0), ("assign", 2, 1), ("assign", 3, 2), ("assign", 4, 3), ("assign", 5, 4)]
    step(sched, out)  # 18 computed: the residual window (4 tokens) is 14..17 -> blocks 3, 4 stay 16-bit
    out = sched.schedule()
    # Block 1 (logical 0) holds the sink: it stays 16-bit. Logical blocks 1, 2 (ids 2, 3) are packed.
    assert out.kv_ops == [("quantize", 2, 1), ("quantize", 3, 2)]
    assert [bm.is_fp(b) for b in s.block_table] == [True, False, False, True, True]
    assert bm.num_fp_live() == 3 and bm.blocks_quantized_total == 2
    step(sched, out)
    out = sched.schedule()  # 19 computed: the window 15..18 still touches block id 4 (tokens 12..15)
    assert not out.kv_ops
    step(sched, out)
    out = sched.schedule()  # 20 computed: the window is 16..19, block id 4 is immutable and outside
    assert out.kv_ops == [("quantize", 4, 3), ("assign", 6, 5)]  # and the decode opens block 6
    # Packed exactly once: later steps never repeat a block.
    step(sched, out)
    assert all(op != "quantize" for op, _, _ in sched.schedule().kv_ops)
    bm.check_integrity(sched.live_sequences())


def test_without_protection_the_sink_block_is_packed_too() -> None:
    bm, sched = make(policy=CachePolicy(residual_window=0, keep_protected_16bit=False, protected_positions=(0,)))
    s = seq("s", 9)
    sched.add(s)
    step(sched, sched.schedule())
    assert sched.schedule().kv_ops == [("quantize", 1, 0), ("quantize", 2, 1)]
    assert [bm.is_fp(b) for b in s.block_table] == [False, False, True]


def test_side_pool_limits_admission_like_blocks_do() -> None:
    bm, sched = make(num_blocks=11, num_fp=3, policy=CachePolicy(residual_window=0, protected_positions=(0,)))
    a, b = seq("a", 10, arrival=0), seq("b", 4, arrival=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # 10 free blocks but only 3 side-pool slots: a takes all three, b waits.
    assert [i.seq.request_id for i in out.scheduled] == ["a"] and bm.num_allocatable == 0
    step(sched, out)
    out = sched.schedule()  # a's logical block 1 (tokens 4..7) is full: packed, its slot goes to b
    assert out.kv_ops == [("quantize", 2, 1), ("assign", 4, 1)]
    assert [i.seq.request_id for i in out.scheduled] == ["a", "b"] and b.block_table == [4]
    bm.check_integrity(sched.live_sequences())


def test_freed_cached_block_keeps_its_slot_until_the_slot_is_needed() -> None:
    bm = BlockManager(6, 4, num_fp_blocks=2)
    a = seq("a", 5)
    bm.append_slots(a, 5)  # blocks 1, 2
    a.num_computed_tokens = 5
    bm.commit_full_blocks(a)  # block 1 is hashed
    bm.take_kv_ops()
    bm.free(a)
    # Block 2 (not cached) gives its slot back; cached block 1 keeps its 16-bit data for a prefix hit.
    assert bm.take_kv_ops() == [("assign", 2, -1)]
    assert bm.fp_slot[1] == 0 and list(bm.fp_cached_free) == [1] and bm.num_fp_available == 2
    b = seq("b", 8)
    assert bm.match_prefix(b.token_ids) == [1]
    c = seq("c", 12)
    c.token_ids = list(range(900, 912))
    bm.append_slots(c, 8)  # needs 2 slots: the free one, then block 1's (block 1 leaves the prefix cache)
    assert bm.take_kv_ops() == [("assign", 3, 1), ("assign", 1, -1), ("assign", 4, 0)]
    assert bm.match_prefix(b.token_ids) == [] and bm.fp_slot[1] == -1
    bm.check_integrity([c])


def test_a_shared_packed_block_stays_shared_and_its_copy_is_packed() -> None:
    bm = BlockManager(8, 4, num_fp_blocks=4)
    a = seq("a", 9)
    bm.append_slots(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    bm.quantize(a.block_table[1])
    bm.take_kv_ops()
    b = seq("b", 9)
    hits = bm.match_prefix(b.token_ids)
    bm.take_prefix(b, hits)
    assert b.block_table == [1, 2] and bm.ref_counts[2] == 2 and not bm.is_fp(2)
    # Copy-on-write of the packed block (e.g. before a rotation): the copy is packed as well.
    assert bm.make_private(b, 1) == (2, 4)
    assert bm.take_kv_ops() == [("assign", 4, 3), ("assign", 4, -1), ("copy", 2, 4)]
    assert not bm.is_fp(4) and bm.ref_counts[2] == 1
    bm.check_integrity([a, b])


def test_protected_blocks_stay_16bit_through_eviction_and_rotation() -> None:
    policy = CachePolicy(eviction_policy="sliding_window", window=8, residual_window=4, protected_positions=(0,))
    bm, sched = make(num_blocks=12, num_fp=5, block_size=4, budget=4, policy=policy)
    s = seq("s", 40)
    sched.add(s)
    rotations, evicted = [], 0
    while s.num_computed_tokens < 40:
        out = sched.schedule()
        rotations += [blk for blk, _ in out.rotations]
        evicted += len(out.evictions)
        bm.check_integrity(sched.live_sequences())
        sink = s.block_table[0]
        assert bm.is_fp(sink), "the sink block was packed"
        # Kept non-protected blocks older than the residual window are packed.
        residual_start = max(0, s.num_computed_tokens - 4) // 4
        for i, b in enumerate(s.block_table[1:residual_start], start=1):
            assert b == 0 or not bm.is_fp(b)
        step(sched, out)
    assert evicted and set(rotations) == {s.block_table[0]}


def test_side_pool_pressure_packs_protected_blocks_and_counts_them() -> None:
    # 6 protected blocks, a 4-slot side pool: protection cannot hold, so it yields instead of deadlocking.
    protected = tuple(range(0, 24, 4))
    bm, sched = make(num_blocks=12, num_fp=4, block_size=4, budget=4,
                     policy=CachePolicy(residual_window=0, protected_positions=protected))
    s = seq("s", 24, protected=protected)
    sched.add(s)
    while s.num_computed_tokens < 24:
        step(sched, sched.schedule())
    assert sched.blocks_protected_quantized > 0
    bm.check_integrity(sched.live_sequences())


def test_bad_side_pool_size() -> None:
    with pytest.raises(ValueError, match="num_fp_blocks"):
        BlockManager(4, 4, num_fp_blocks=0)


def test_a_packed_block_is_promoted_to_16bit_once_before_its_first_rotation() -> None:
    # Protection off: the sink block is packed like any other, then kept by the window's rotation.
    policy = CachePolicy(eviction_policy="sliding_window", window=8, residual_window=0, keep_protected_16bit=False,
                         protected_positions=(0,))
    bm, sched = make(num_blocks=12, num_fp=5, block_size=4, budget=4, policy=policy)
    s = seq("s", 40)
    sched.add(s)
    ops = []
    while s.num_computed_tokens < 40:
        out = sched.schedule()
        ops += out.kv_ops
        step(sched, out)
        bm.check_integrity(sched.live_sequences())
    sink = s.block_table[0]
    # Block 1 held the sink, was packed once when full, and (being in the prefix cache) was copied before
    # the first rotation; the packed copy is promoted to 16-bit, once.
    assert ("quantize", 1, 0) in ops and ("copy", 1, sink) in ops
    promoted = [op for op in ops if op[0] == "dequantize"]
    assert promoted == [("dequantize", sink, promoted[0][2])]  # once, at the first eviction
    assert bm.is_fp(sink) and [op for op in ops if op[1] == sink][-1][0] == "dequantize"  # never re-packed
