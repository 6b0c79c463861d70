"""Block manager: exact block ids and free-queue order, on the CPU, without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.memory.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def test_bookkeeping_modules_do_not_import_torch() -> None:
    code = (
        "import sys; import engine.memory.block_manager, engine.core.scheduler, engine.memory.retention, engine.cache_policy;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_order() -> None:
    bm = BlockManager(num_blocks=11, block_size=4)
    assert list(bm.free_queue) == list(range(1, 11))
    a = seq(list(range(10)), "a")
    assert bm.append_slots(a, 10) == [1, 2, 3]
    b = seq(list(range(100, 105)), "b")
    assert bm.append_slots(b, 5) == [4, 5]
    bm.check_integrity([a, b])
    bm.free(a)  # tail first
    assert list(bm.free_queue) == [6, 7, 8, 9, 10, 3, 2, 1]
    bm.check_integrity([b])
    c = seq([1] * 12, "c")
    assert bm.append_slots(c, 12) == [6, 7, 8]
    bm.free(b)
    bm.free(c)
    assert list(bm.free_queue) == [9, 10, 3, 2, 1, 5, 4, 8, 7, 6]
    bm.check_integrity([])


def test_append_grows_table_one_block_at_a_time() -> None:
    bm = BlockManager(num_blocks=5, block_size=4)
    s = seq([1, 2, 3])
    bm.append_slots(s, 3)
    assert s.block_table == [1]
    s.num_computed_tokens = 3
    assert bm.num_new_blocks(s, 1) == 0
    s.num_computed_tokens = 4
    assert bm.num_new_blocks(s, 1) == 1
    bm.append_slots(s, 1)
    assert s.block_table == [1, 2]
    with pytest.raises(RuntimeError):
        s.num_computed_tokens = 8
        bm.append_slots(s, 12)
    bm.check_integrity([s])


def test_prefix_cache_shares_and_revives_blocks() -> None:
    bm = BlockManager(num_blocks=11, block_size=4)
    prompt = list(range(10))
    a = seq(prompt, "a")
    assert bm.match_prefix(prompt) == []
    bm.take_prefix(a, [])
    bm.append_slots(a, 10)  # blocks 1, 2, 3
    a.num_computed_tokens = 10
    bm.commit_full_blocks(a)  # blocks 1 and 2 are full
    assert a.num_hashed_blocks == 2
    b = seq(prompt[:8] + [99, 98, 97], "b")
    hits = bm.match_prefix(b.token_ids)
    assert hits == [1, 2]
    assert bm.num_hits_in_free_queue(hits) == 0
    bm.take_prefix(b, hits)
    assert b.num_computed_tokens == 8 and b.block_table == [1, 2]
    assert bm.ref_counts[1] == 2 and bm.ref_counts[2] == 2
    bm.append_slots(b, 3)
    assert b.block_table == [1, 2, 4]
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    # A third request revives the cached blocks from the free queue.
    c = seq(prompt, "c")
    hits = bm.match_prefix(c.token_ids)
    assert hits == [1, 2]
    assert bm.num_hits_in_free_queue(hits) == 2
    bm.take_prefix(c, hits)
    assert list(bm.free_queue) == [5, 6, 7, 8, 9, 10, 3, 4]
    assert bm.prefix_hit_tokens == 16
    bm.check_integrity([c])


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(list(range(8)), "a")
    bm.append_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a)
    # An identical 8-token prompt may reuse only the first block: the last token must produce logits.
    assert bm.match_prefix(list(range(8))) == [1]


def test_reallocation_drops_stale_hash() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([5, 6, 7], "a")
    bm.append_slots(a, 3)
    a.num_computed_tokens = 3
    bm.commit_full_blocks(a)
    bm.free(a)
    assert bm.match_prefix([5, 6, 7]) == [1]
    b = seq([1, 1, 1, 1], "b")
    bm.append_slots(b, 4)  # takes blocks 2 then 1, overwriting cached block 1
    assert b.block_table == [2, 1]
    assert bm.match_prefix([5, 6, 7]) == []
    bm.check_integrity([b])


def test_evict_points_table_at_null_block_and_copy_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq(list(range(8)), "a")
    bm.append_slots(a, 8)  # [1, 2, 3, 4]
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a)
    assert bm.evict_blocks(a, [1, 2]) == [2, 3]
    assert a.block_table == [1, 0, 0, 4]
    assert list(bm.free_queue) == [5, 6, 7, 2, 3]
    # Block 1 is hashed (prefix cache): modifying it in place would corrupt other readers.
    assert bm.make_private(a, 0) == (1, 5)
    assert a.block_table == [5, 0, 0, 4]
    assert list(bm.free_queue) == [6, 7, 2, 3, 1]
    assert bm.make_private(a, 0) is None  # already private
    bm.check_integrity([a])


def test_integrity_detects_leak() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3], "a")
    bm.append_slots(a, 3)
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity([])
