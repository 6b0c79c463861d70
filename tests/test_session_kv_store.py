"""Session KV bookkeeping without torch: the store's size bound and age eviction (exact entries), block
keys (a shared prefix is one key), manifests, restore plans, and the block manager's restore books
(exact block ids, nothing leaked)."""

from __future__ import annotations

import os
import sys

import pytest

from engine.memory.block_manager import BlockManager
from engine.memory.kv_store import DirectoryKVStore, EvictionIndex
from engine.memory.session_kv import Manifest, block_key, chain_keys, context_key, plan_restore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_eviction_index_evicts_the_least_recently_used_first_then_by_age() -> None:
    ix = EvictionIndex()
    for key, at in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        ix.add(key, 10, at)
    ix.touch("a", 4.0)
    assert ix.victims(now=5.0, max_bytes=25, max_age_s=100) == ["b"]
    assert ix.victims(now=5.0, max_bytes=5, max_age_s=100) == ["b", "c", "a"]
    assert ix.victims(now=103.5, max_bytes=100, max_age_s=100) == ["b", "c"]  # a was used at 4.0
    assert ix.victims(now=5.0, max_bytes=15, max_age_s=100, keep=frozenset({"b"})) == ["c", "a"]
    ix.remove("b")
    assert ix.total_bytes == 20 and len(ix) == 2 and "b" not in ix


def test_directory_store_bounds_its_size_and_evicts_by_age(tmp_path) -> None:
    clock = Clock()
    store = DirectoryKVStore(str(tmp_path), max_bytes=250, max_age_s=60, clock=clock)
    store.put_block("k1-q", b"x" * 100)
    clock.t += 1
    store.put_block("k2-q", b"y" * 100)
    clock.t += 1
    assert store.get_block("k1-q") == b"x" * 100  # k1 is now the more recently used
    clock.t += 1
    store.put_block("k3-f", b"z" * 100)  # 300 > 250: the least recently used (k2) goes
    assert store.get_block("k2-q") is None
    assert store.get_block("k1-q") is not None and store.get_block("k3-f") is not None
    c = store.counters
    assert (c.evictions, c.entries, c.bytes, c.misses) == (1, 2, 200, 1)
    assert sorted(os.listdir(tmp_path / "b" / "k1")) == ["k1-q"] and not (tmp_path / "b" / "k2" / "k2-q").exists()
    # Age: 61 s later a manifest's save sweeps everything unused since.
    clock.t += 61
    store.put_manifest("conv-1", b"{}")
    assert store.evict() == ["b/k1/k1-q", "b/k3/k3-f"]
    assert store.get_manifest("conv-1") == b"{}" and store.counters.entries == 1


def test_a_second_store_on_the_same_directory_sees_and_bounds_the_first_ones_entries(tmp_path) -> None:
    clock = Clock()
    a = DirectoryKVStore(str(tmp_path), max_bytes=250, max_age_s=60, clock=clock)
    b = DirectoryKVStore(str(tmp_path), max_bytes=250, max_age_s=60, clock=clock)
    a.put_block("aa-q", b"1" * 100)
    clock.t += 1
    b.put_block("bb-q", b"2" * 100)
    assert b.get_block("aa-q") == b"1" * 100  # written by the other store
    os.utime(tmp_path / "b" / "aa" / "aa-q", (clock.t + 1, clock.t + 1))
    clock.t += 2
    b.put_block("cc-q", b"3" * 100)  # b re-reads the directory: bb (t=1001) is the oldest
    assert a.get_block("bb-q") is None and a.get_block("aa-q") is not None


def test_store_keys_cannot_leave_the_directory(tmp_path) -> None:
    store = DirectoryKVStore(str(tmp_path), 100, 60)
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ValueError):
            store.put_manifest(bad, b"{}")


def test_a_shared_prefix_has_the_same_keys_in_every_session_and_none_across_policies() -> None:
    ctx = context_key("model-fp", "policy-1", "int4/x")
    system = list(range(100, 228))  # 2 blocks of 64
    s1 = chain_keys(ctx, system + [1] * 64, 64)
    s2 = chain_keys(ctx, system + [2] * 64, 64)
    assert s1[:2] == s2[:2] and s1[2] != s2[2]
    assert chain_keys(context_key("model-fp", "policy-2", "int4/x"), system, 64)[0] != s1[0]
    assert block_key(s1[0], True) != block_key(s1[0], False)


def test_manifest_round_trips_and_plans_say_why_they_fall_back() -> None:
    toks = tuple(range(8))
    m = Manifest("conv-1", "fp", "pv", "lay", 4, toks, ("a-q", "b-f"), (0, 1), 12.5)
    assert Manifest.from_json(m.to_json()) == m
    ok = dict(model="fp", policy_version="pv", kv_layout="lay", block_size=4)
    assert plan_restore(m, prompt=list(toks) + [9], **ok).num_blocks == 2
    assert plan_restore(None, prompt=[1, 2], **ok).reason == "no_manifest"
    assert plan_restore(m, prompt=list(toks) + [9], **{**ok, "model": "other"}).reason == "model"
    assert plan_restore(m, prompt=list(toks) + [9], **{**ok, "policy_version": "pv2"}).reason == "policy"
    assert plan_restore(m, prompt=list(toks) + [9], **{**ok, "kv_layout": "int8"}).reason == "kv_layout"
    assert plan_restore(m, prompt=list(toks) + [9], **{**ok, "block_size": 8}).reason == "kv_layout"
    assert plan_restore(m, prompt=[7] + list(toks), **ok).reason == "not_prefix"


def test_block_manager_restores_into_the_prefix_cache_with_exact_ids() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_fp_blocks=3)
    tokens = list(range(13))
    blocks = bm.reserve_restore([True, False, False])
    assert blocks == [1, 2, 3]
    assert bm.take_kv_ops() == [("assign", 1, 0), ("assign", 2, 1), ("assign", 2, -1), ("assign", 3, 2),
                                ("assign", 3, -1)]
    assert [bm.fp_slot[b] for b in blocks] == [0, -1, -1]
    bm.commit_restore(blocks, bm.chain_hashes(tokens, 3))
    assert list(bm.free_queue)[-3:] == [3, 2, 1] and bm.num_used_blocks == 0
    assert bm.match_prefix(tokens) == [1, 2, 3]  # the admission's prefix hits
    assert list(bm.fp_cached_free) == [1]  # the 16-bit block keeps its slot while cached
    bm.check_integrity([])


def test_block_manager_releases_a_restore_that_failed_and_holds_local_hits_meanwhile() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, num_fp_blocks=2)
    local = bm.reserve_restore([False])
    bm.commit_restore(local, bm.chain_hashes([1, 2, 3, 4, 5], 1))
    bm.hold(local)
    blocks = bm.reserve_restore([True, True, True])  # only 2 side-pool slots: 2 blocks
    assert blocks == [2, 3] and local[0] not in blocks
    bm.release(blocks)  # the load failed: unhashed, slots back
    bm.release(local)
    bm.check_integrity([])
    assert bm.num_fp_available == 2 and bm.num_free_blocks == 5
    assert bm.match_prefix([1, 2, 3, 4, 5]) == local  # the local hit survived


def test_pure_modules_do_not_import_torch() -> None:
    import subprocess

    code = ("import sys, engine.memory.session_kv, engine.memory.kv_store, engine.memory.session_kv_config, engine.memory.session_cache, "
            "engine.memory.kv_store_redis, engine.memory.kv_store_tiered; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), check=True)
    assert out.stdout.strip() == "False"
