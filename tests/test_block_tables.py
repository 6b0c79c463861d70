"""Persistent block tables: the block manager's ``table_ops`` and the runner's mirror (``BlockTables``) give,
at every step, exactly the tables the sequences' lists give (eviction, preemption, prefix caching,
copy-on-write, quantized KV, aborts)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.memory.block_manager import BlockManager, apply_table_ops
from engine.cache_policy import CachePolicy
from engine.memory.retention import blocks_of
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence
from engine.worker.sparse_config import SparseAttention
from engine.worker.step_inputs import BlockTables, tables_from_lists


def test_table_ops_name_exact_rows_and_block_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(8)), SamplingParams())
    b = Sequence("b", list(range(50, 54)), SamplingParams())
    bm.append_slots(a, 8)
    bm.append_slots(b, 4)
    assert bm.take_table_ops() == [("write", 0, 0, [1, 2]), ("write", 1, 0, [3])]
    a.num_computed_tokens = 8
    bm.append_slots(a, 1)
    bm.append_slots(a, 0)  # no new block: nothing to ship
    bm.evict_blocks(a, [1])
    assert a.block_table == [1, 0, 4]
    assert bm.take_table_ops() == [("write", 0, 2, [4]), ("write", 0, 1, [0])]
    bm.free(a)
    c = Sequence("c", list(range(90, 95)), SamplingParams())
    bm.append_slots(c, 5)  # the lowest free row again (row 0), the oldest free blocks (5, 6)
    assert bm.take_table_ops() == [("clear", 0, 3, []), ("write", 0, 0, [5, 6])]
    assert (a.table_row, b.table_row, c.table_row) == (-1, 1, 0)
    rows: list[list[int]] = []
    apply_table_ops(rows, [("write", 0, 0, [1, 2]), ("write", 1, 0, [3]), ("write", 0, 2, [4]), ("write", 0, 1, [0]),
                           ("clear", 0, 3, []), ("write", 0, 0, [5, 6])])
    assert rows == [[5, 6], [3]]


def test_copy_on_write_and_prefix_hits_are_logged() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(9)), SamplingParams())
    bm.append_slots(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    b = Sequence("b", list(range(9)), SamplingParams())
    hits = bm.match_prefix(b.token_ids)
    bm.take_prefix(b, hits)
    bm.take_table_ops()
    assert b.block_table == [1, 2] and b.table_row == 1
    assert bm.make_private(b, 0) == (1, 4)
    assert bm.take_table_ops() == [("write", 1, 0, [4])]


def _check_mirror(rows: list[list[int]], mirror: BlockTables, live: list[Sequence], free_rows: list[int]) -> None:
    for seq in live:
        if seq.table_row < 0:
            assert not seq.block_table
            continue
        assert rows[seq.table_row] == seq.block_table, seq.request_id
    for r in free_rows:
        assert r >= len(rows) or not any(rows[r])
    width = mirror.table.shape[1]
    want = tables_from_lists([rows[r] if r < len(rows) else [] for r in range(mirror.table.shape[0])] + [[0] * width],
                             torch.device("cpu"))[:-1]
    assert torch.equal(mirror.table, want)


def _random_run(quantized: bool, seed: int) -> tuple[int, int, int]:
    """One randomized schedule (see the test); returns (preemptions, steps with evictions, copy-on-write copies)."""
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=32, block_size=bs, num_fp_blocks=20 if quantized else None)
    policy = CachePolicy(eviction_policy="sliding_window", window=12, protected_positions=(0,), residual_window=8)
    sched = Scheduler(bm, policy, max_num_seqs=6, max_num_batched_tokens=12)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    rows: list[list[int]] = []
    mirror = BlockTables(2, 2, torch.device("cpu"))  # small: the ops grow it
    arrivals = evicting = copies = 0
    for _ in range(400):
        if rng.random() < 0.3 and len(sched.live_sequences()) < 8:
            base = rng.choice(prompts)  # shared prefixes: prefix-cache hits, then copy-on-write rotations
            seq = Sequence(f"r{arrivals}", base + [rng.randrange(3, 100) for _ in range(rng.randrange(0, 6))],
                           SamplingParams(), arrival=arrivals)
            seq.protected_positions = [0]
            seq.protected_blocks = blocks_of([0], bs)
            arrivals += 1
            sched.add(seq)
        out = sched.schedule()
        evicting += bool(out.evictions)
        ops = bm.take_table_ops()
        apply_table_ops(rows, ops)
        mirror.apply(ops)
        copies += len(out.copies) + sum(op == "copy" for op, _, _ in out.kv_ops)
        if out.scheduled:
            seqs = [item.seq for item in out.scheduled]
            got = mirror.gather([s.table_row for s in seqs], max(len(s.block_table) for s in seqs))
            assert torch.equal(got, tables_from_lists([s.block_table for s in seqs], torch.device("cpu")))
        sched.update_after_step(out, [rng.randrange(3, 100) for item in out.scheduled if item.samples])
        for seq in list(sched.running):
            if seq.num_output_tokens >= 40 or rng.random() < 0.02:  # finished, or aborted
                sched.finish(seq, "stop")
        bm.check_integrity(sched.live_sequences())
        ops = bm.take_table_ops()  # the frees, shipped with the next step's input
        apply_table_ops(rows, ops)
        mirror.apply(ops)
        _check_mirror(rows, mirror, sched.live_sequences(), bm._free_rows)
    for seq in sched.live_sequences():
        sched.finish(seq, "abort")
    apply_table_ops(rows, bm.take_table_ops())
    assert not any(any(r) for r in rows)
    return sched.num_preemptions, evicting, copies


@pytest.mark.parametrize("quantized", [False, True])
def test_randomized_schedule_keeps_the_mirror_equal_to_the_lists(quantized: bool) -> None:
    """Admissions with shared prefixes, decodes, sliding-window eviction with a protected block and
    copy-on-write rotations, preemption under a tight pool, aborts: after every step the ops, applied to a
    list mirror and to ``BlockTables``, give each live sequence's table, and the step's gathered table is the
    one built from the lists. (Seeds whose pool pressure hits the scheduler's "no free block to copy shared
    block" error -- eviction's copy-on-write with an empty pool, a limit of the scheduler, not of the tables --
    are not among these.)"""
    runs = [_random_run(quantized, seed) for seed in range(5)]
    assert sum(r[0] for r in runs) > 0, "no preemption: the run no longer covers it"
    assert all(r[1] > 0 for r in runs) and sum(r[2] for r in runs) > 0


def _spy(engine: LLMEngine) -> list[int]:
    """Compare every step's table (the runner's mirror) with the table built from the sequences' lists."""
    runner = engine.executor.runner
    expected: list[list[list[int]]] = []
    checked = [0]
    model_input = engine._model_input
    step_tables = runner.step_tables

    def spy_input(sched):  # type: ignore[no-untyped-def]
        expected.append([list(item.seq.block_table) for item in sched.scheduled])
        return model_input(sched)

    def spy_tables(inp):  # type: ignore[no-untyped-def]
        got = step_tables(inp)
        want = tables_from_lists(expected.pop(), got.device)
        assert torch.equal(got, want), (got.tolist(), want.tolist())
        checked[0] += 1
        return got

    engine._model_input = spy_input
    runner.step_tables = spy_tables
    return checked


@pytest.mark.parametrize("kind", ["dense", "int8-sparse"])
def test_engine_steps_see_the_tables_of_the_lists(tiny_llama: Path, kind: str) -> None:
    kw: dict = dict(block_size=4, num_kv_blocks=30)
    if kind == "int8-sparse":
        kw = dict(block_size=8, num_kv_blocks=24, kv_cache_dtype="int8",
                  sparse=SparseAttention(enabled=True, indexer="block_bounds", min_context=32, top_k=16, local_window=8))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), max_num_batched_tokens=16, **kw,
                                    cache_policy=CachePolicy(eviction_policy="sliding_window", window=24,
                                                             protected_positions=(0, 1), residual_window=8)))
    checked = _spy(engine)
    rng = random.Random(0)
    # Two requests share a prefix (a prefix-cache hit, then copy-on-write when the shared block rotates);
    # the others are distinct, so the tight pool preempts without running eviction's copies out of blocks.
    shared = [rng.randrange(3, 200) for _ in range(20)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(6):
        head = shared if i < 2 else [rng.randrange(3, 200) for _ in range(20)]
        engine.add_request(f"r{i}", head + [rng.randrange(3, 200) for _ in range(rng.randrange(0, 20))], params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 5:
            engine.abort("r5")
        engine.check_integrity()
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.tokens_evicted > 0
    assert checked[0] == engine.counters.steps_total > 0  # every step that ran a forward
    runner = engine.executor.runner
    runner.block_tables.apply(engine.block_manager.take_table_ops())  # the last frees: every row zero again
    assert not runner.block_tables.table.any()


GROWING_OPS = [("write", 0, 0, [5, 6]), ("write", 3, 0, [1, 2, 3]), ("write", 0, 1, [0]), ("clear", 3, 3, []),
               ("write", 3, 0, [9]), ("write", 1, 40, [7])]  # row 3 and column 40 past the capacity: it grows


def test_the_mirror_grows_and_gathers_exact_ids() -> None:
    m = BlockTables(2, 4, torch.device("cpu"))
    m.apply(GROWING_OPS)
    assert m.table.shape == (4, 41)
    assert m.gather([0, 3], 2).tolist() == [[5, 0], [9, 0]]
    assert m.gather([3, 1, 0], 41)[:, 38:].tolist() == [[0, 0, 0], [0, 0, 7], [0, 0, 0]]
    assert m.gather([2], 0).tolist() == [[0]]  # width at least 1, as the lists' tables


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_mirror_on_a_cuda_device_matches_the_cpu_one() -> None:
    cpu, gpu = BlockTables(2, 4, torch.device("cpu")), BlockTables(2, 4, torch.device("cuda"))
    cpu.apply(GROWING_OPS)
    gpu.apply(GROWING_OPS)
    for rows, width in (([0, 3], 2), ([3, 1, 0], 41)):
        assert torch.equal(gpu.gather(rows, width).cpu(), cpu.gather(rows, width))
