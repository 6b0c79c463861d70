"""Session KV through the engine (the reference model, int4 KV): a turn's blocks saved on engine A are
restored on a fresh engine B, whose greedy continuation equals B re-prefilling the whole conversation;
packed blocks round-trip bit for bit; another policy re-prefills and says so; a shared prefix is stored
once; a restore that fails midway leaks nothing."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError, InvalidRequestError
from engine.memory.session_kv_config import SessionKV

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "assets/reference-model")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def make(store: Path | None, dtype: str = "int4", **policy) -> LLMEngine:
    kv = SessionKV(enabled=store is not None, path=str(store or "/nonexistent"))
    return LLMEngine(EngineConfig(model=MODEL, kv_cache_dtype=dtype, num_kv_blocks=48, max_model_len=1024,
                                  max_num_batched_tokens=256, session_kv=kv,
                                  cache_policy=CachePolicy(eviction_policy="none", **policy)))


def run(eng: LLMEngine, prompt: list[int], session: str | None) -> tuple[list[int], int]:
    eng.add_request(None, prompt, GREEDY, session=session)
    toks: list[int] = []
    cached = 0
    while eng.has_unfinished():
        for out in eng.step():
            toks += out.token_ids
            cached = out.cached_tokens or cached
    eng.check_integrity()
    return toks, cached


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    """Turn 1 on engine A (saved), the turn-2 prompt, and what a fresh engine re-prefilling it answers."""
    store = tmp_path_factory.mktemp("skv")
    a = make(store)
    t1 = words(300, 1)
    a1, _ = run(a, t1, "conv-1")
    t2 = t1 + a1 + words(40, 2)
    refill, cached = run(make(None), t2, None)
    assert cached == 0
    return {"store": store, "a": a, "t2": t2, "refill": refill}


def test_a_fresh_engine_restores_the_turn_and_continues_as_re_prefilling_does(conversation) -> None:
    b = make(conversation["store"])
    toks, cached = run(b, conversation["t2"], "conv-1")
    assert toks == conversation["refill"]
    assert cached == 256  # 4 of the 312 computed tokens' blocks (64 each) came from the store
    s = b.stats()
    assert (s.session_kv_restores, s.session_kv_restored_tokens, s.session_kv_fallbacks) == (1, 256, ())
    assert s.prefix_cache_hit_tokens == 256


def test_int4_blocks_round_trip_bit_exactly(conversation, tmp_path) -> None:
    """Every stored block loaded into another engine and read back gives the same bytes."""
    b = make(conversation["store"])
    store = b.session_kv.store
    man = __import__("engine.memory.session_kv", fromlist=["Manifest"]).Manifest.from_json(store.get_manifest("conv-1"))
    assert any(k.endswith("-q") for k in man.keys) and any(k.endswith("-f") for k in man.keys)
    payloads = [store.get_block(k) for k in man.keys]
    bm = b.block_manager
    blocks = bm.reserve_restore([k.endswith("-f") for k in man.keys])
    b.executor.import_kv_blocks(bm.take_kv_ops(), blocks, payloads)
    assert b.executor.export_kv_blocks(bm.take_kv_ops(), blocks) == payloads
    bm.release(blocks)
    b.check_integrity()


def test_another_policy_re_prefills_and_says_why(conversation, caplog, tmp_path) -> None:
    import shutil

    store = shutil.copytree(conversation["store"], tmp_path / "copy")  # its save replaces the manifest
    b = make(store, residual_window=64)  # another protection set: another policy version
    with caplog.at_level(logging.WARNING, logger="engine.memory.session_cache"):
        toks, cached = run(b, conversation["t2"], "conv-1")
    assert cached == 0 and b.stats().session_kv_fallbacks == (("policy", 1),)
    assert "KV not restored (policy: saved under policy" in caplog.text
    assert len(toks) == GREEDY.max_tokens


def test_an_unknown_session_counts_a_miss_and_runs(conversation) -> None:
    b = make(conversation["store"])
    toks, cached = run(b, conversation["t2"], "conv-never-saved")
    assert toks == conversation["refill"] and cached == 0
    assert b.stats().session_kv_fallbacks == (("no_manifest", 1),)


def test_a_shared_system_prompt_is_stored_once(tmp_path) -> None:
    eng = make(tmp_path)
    system = words(128, 7)  # 2 blocks
    run(eng, system + words(100, 8), "conv-a")
    before = eng.stats()
    run(eng, system + words(100, 9), "conv-b")
    after = eng.stats()
    # conv-b's save found the two system blocks (packed, same keys) already stored.
    assert after.session_kv_shared_blocks - before.session_kv_shared_blocks == 2
    files = sorted(p.name for p in (tmp_path / "b").rglob("*-*"))
    manifests = [eng.session_kv.store.get_manifest(s) for s in ("conv-a", "conv-b")]
    from engine.memory.session_kv import Manifest

    ka, kb = (Manifest.from_json(m).keys for m in manifests)
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert len(files) == len(set(ka) | set(kb))


def test_a_restore_that_fails_midway_leaks_nothing_and_the_turn_re_prefills(conversation, monkeypatch) -> None:
    from engine.memory import kv_block_codec

    real = kv_block_codec.write_block
    calls = []

    def flaky(caches, block, slot, data):
        calls.append(block)
        if len(calls) == 3:
            raise OSError("disk went away")
        real(caches, block, slot, data)

    monkeypatch.setattr(kv_block_codec, "write_block", flaky)
    b = make(conversation["store"])
    free = b.block_manager.num_free_blocks
    toks, cached = run(b, conversation["t2"], "conv-1")
    assert len(calls) == 3 and cached == 0
    assert toks == conversation["refill"]
    assert b.stats().session_kv_fallbacks == (("error", 1),)
    b.check_integrity()
    assert b.block_manager.num_free_blocks == free


def test_a_save_that_fails_is_counted_and_the_turn_still_answers(conversation, tmp_path, caplog, monkeypatch) -> None:
    """A disk error while saving (not a store outage): the answer is what re-prefilling gives, the engine's
    books stay whole, the failure is logged with its reason and counted; nothing was stored, so the next
    engine re-prefills the turn (``no_manifest``)."""
    from engine.memory.kv_store import DirectoryKVStore

    def broken(self, key, data):
        raise OSError("No space left on device")

    monkeypatch.setattr(DirectoryKVStore, "put_block", broken)
    a = make(tmp_path)
    with caplog.at_level(logging.ERROR, logger="engine.memory.session_cache"):
        toks, cached = run(a, conversation["t2"], "conv-2")
    assert toks == conversation["refill"] and cached == 0
    assert a.stats().session_kv_save_failures == (("error", 1),) and a.stats().session_kv_saves == 0
    assert "saving KV failed" in caplog.text and "No space left on device" in caplog.text
    monkeypatch.undo()
    b = make(tmp_path)
    _, cached = run(b, conversation["t2"] + [7, 8, 9], "conv-2")
    assert cached == 0 and b.stats().session_kv_fallbacks == (("no_manifest", 1),)


def test_session_ids_and_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="session_kv.enabled"):
        EngineConfig(model=MODEL, enable_prefix_caching=False, session_kv=SessionKV(enabled=True))
    with pytest.raises(ConfigError, match="session_kv.max_bytes"):
        SessionKV(max_bytes=0)
    eng = make(None)
    with pytest.raises(InvalidRequestError, match="session"):
        eng.add_request(None, [1, 2, 3], GREEDY, session="../etc")
