"""Session KV on Redis through the engine's config (``session_kv: {backend: redis, url: ...}``, the reference
model, int4 KV): a turn saved by engine A is restored by a fresh engine B whose greedy continuation equals
re-prefilling; with the server killed, a turn re-prefills with the reason ``store_unavailable`` logged
and counted, and its save is a logged warning -- never a failed turn."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine import LLMEngine
from engine.config_io import engine_config_from_dict
from engine.memory.kv_store_redis import RedisKVStore
from engine.memory.kv_store_tiered import TieredKVStore
from tests.serve.redis_server import kill_redis, redis_server
from tests.test_session_kv_engine import run, words  # one turn through an engine, and its prompt words

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "assets/reference-model")


def make(session_kv: dict | None) -> LLMEngine:
    """An engine from the config a pool's ``engine:`` block holds."""
    return LLMEngine(engine_config_from_dict({
        "model": MODEL, "kv_cache_dtype": "int4", "num_kv_blocks": 48, "max_model_len": 1024,
        "max_num_batched_tokens": 256, "cache_policy": {"eviction_policy": "none"},
        **({"session_kv": {"enabled": True, **session_kv}} if session_kv else {})}))


@pytest.fixture(scope="module")
def conversation():
    """Turn 1's prompt, the turn-2 prompt, and what a fresh engine re-prefilling turn 2 answers."""
    t1 = words(300, 1)
    a1, _ = run(make(None), t1, None)
    t2 = t1 + a1 + words(40, 2)
    refill, cached = run(make(None), t2, None)
    assert cached == 0
    return {"t1": t1, "t2": t2, "refill": refill}


def test_a_turn_saved_to_redis_is_restored_by_another_engine(conversation, tmp_path) -> None:
    with redis_server(str(tmp_path)) as url:
        cfg = {"backend": "redis", "url": url, "prefix": "app1:kv:"}
        a = make(cfg)
        assert isinstance(a.session_kv.store, RedisKVStore)
        run(a, conversation["t1"], "conv-1")
        sa = a.stats()
        assert sa.session_kv_saves == 1 and sa.session_kv_store_entries == 5  # 4 blocks of 64 + the manifest
        import redis

        r = redis.Redis.from_url(url)
        assert len(r.keys("app1:kv:b:*")) == 4 and r.exists("app1:kv:m:conv-1")
        from engine.memory.session_kv import Manifest

        turn1_keys = set(Manifest.from_json(r.get("app1:kv:m:conv-1")).keys)
        assert int(r.get("app1:kv:bytes")) == sa.session_kv_store_bytes == sa.session_kv_store_bytes_written
        b = make(cfg)
        toks, cached = run(b, conversation["t2"], "conv-1")
        assert toks == conversation["refill"]
        assert cached == 256
        s = b.stats()
        assert (s.session_kv_restores, s.session_kv_restored_tokens, s.session_kv_fallbacks) == (1, 256, ())
        # B's save of turn 2 replaced the manifest; the keys it shares with turn 1's were not written again.
        keys2 = Manifest.from_json(b.session_kv.store.get_manifest("conv-1")).keys
        assert s.session_kv_shared_blocks == len(set(keys2) & turn1_keys) >= 3
        assert len(r.keys("app1:kv:b:*")) == len(set(keys2) | turn1_keys)


def test_tiered_restores_across_both_tiers(conversation, tmp_path) -> None:
    with redis_server(str(tmp_path)) as url:
        # The reference model's int4 blocks are ~32 KB, its 16-bit (fp32 model: side pool in fp32) ~192 KB.
        cfg = {"backend": "tiered", "url": url, "path": str(tmp_path / "kv"), "small_block_bytes": 64 << 10}
        a = make(cfg)
        assert isinstance(a.session_kv.store, TieredKVStore)
        run(a, conversation["t1"], "conv-1")
        import redis

        r = redis.Redis.from_url(url)
        in_redis = sorted(k.decode().removeprefix("sinkserve:kv:b:") for k in r.keys("sinkserve:kv:b:*"))
        on_disk = sorted(p.name for p in (tmp_path / "kv" / "b").rglob("*") if p.is_file())
        assert in_redis and on_disk and all(k.endswith("-q") for k in in_redis) and all(k.endswith("-f") for k in on_disk)
        assert r.exists("sinkserve:kv:m:conv-1") and not list((tmp_path / "kv" / "m").iterdir())
        from engine.memory.session_kv import Manifest

        assert sorted(Manifest.from_json(r.get("sinkserve:kv:m:conv-1")).keys) == sorted(in_redis + on_disk)
        toks, cached = run(make(cfg), conversation["t2"], "conv-1")
        assert toks == conversation["refill"] and cached == 256


def test_redis_down_re_prefills_says_why_and_never_fails_the_turn(conversation, tmp_path, caplog) -> None:
    with redis_server(str(tmp_path)) as url:
        cfg = {"backend": "redis", "url": url}
        a = make(cfg)
        run(a, conversation["t1"], "conv-1")
        kill_redis(url)
        b = make(cfg)
        with caplog.at_level(logging.WARNING, logger="engine.memory.session_cache"):
            toks, cached = run(b, conversation["t2"], "conv-1")
        assert toks == conversation["refill"] and cached == 0
        assert b.stats().session_kv_fallbacks == (("store_unavailable", 1),)
        assert f"KV not restored (store_unavailable: session KV store {url}" in caplog.text
        assert "KV not saved (session KV store" in caplog.text  # the end of the turn: one warning line
        assert b.stats().session_kv_save_failures == (("store_unavailable", 1),)
        assert not b.has_unfinished()
