"""The Redis and tiered session KV stores against a real ``redis-server``: exact keys and bytes, a shared
prefix stored once, eviction by size (least recently used) and by age, two stores on one server seeing
and bounding each other's entries, an unreachable server raising ``KVStoreUnavailable`` with the URL
masked; and how the ``session_kv`` settings choose and check a backend."""

from __future__ import annotations

import pytest

from engine.config_io import session_kv_from_dict
from engine.errors import ConfigError
from engine.memory.kv_store import DirectoryKVStore, KVStore, KVStoreUnavailable
from engine.memory.kv_store_redis import RedisKVStore
from engine.memory.kv_store_tiered import TieredKVStore, open_kv_store
from engine.memory.session_kv_config import SessionKV
from tests.serve.redis_server import redis_server


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(str(tmp_path_factory.mktemp("redis"))) as url:
        yield url


@pytest.fixture
def prefix(request) -> str:
    return f"t:{request.node.name[:40]}:"  # each test its own namespace on the shared server


def test_put_get_with_exact_keys_and_bytes(redis_url, prefix) -> None:
    import redis

    s = RedisKVStore(redis_url, max_bytes=1000, max_age_s=60, prefix=prefix, clock=Clock())
    assert isinstance(s, KVStore)
    s.put_block("3f9a-q", b"\x00\x01" * 50)
    s.put_manifest("conv-42", b'{"keys":["3f9a-q"]}')
    r = redis.Redis.from_url(redis_url)
    assert sorted(k.decode() for k in r.keys(prefix + "*")) == sorted(
        [prefix + "b:3f9a-q", prefix + "m:conv-42", prefix + "lru", prefix + "size", prefix + "bytes"])
    assert r.get(prefix + "b:3f9a-q") == b"\x00\x01" * 50
    assert r.zrange(prefix + "lru", 0, -1, withscores=True) == [(b"b:3f9a-q", 1000.0), (b"m:conv-42", 1000.0)]
    assert int(r.get(prefix + "bytes")) == 100 + 19
    assert s.get_block("3f9a-q") == b"\x00\x01" * 50 and s.get_manifest("conv-42") == b'{"keys":["3f9a-q"]}'
    assert s.get_block("nope-q") is None and s.has_block("3f9a-q") and not s.has_block("nope-q")
    c = s.counters
    assert (c.bytes, c.entries, c.hits, c.misses, c.bytes_written, c.bytes_read) == (119, 2, 2, 1, 119, 119)
    s.put_block("3f9a-q", b"x" * 10)  # a rewrite replaces the size, not adds to it
    assert int(r.get(prefix + "bytes")) == 10 + 19 and s.counters.entries == 2
    with pytest.raises(ValueError):
        s.put_manifest("../x", b"{}")


def test_a_shared_prefix_is_stored_once(redis_url, prefix) -> None:
    """Two sessions whose first block is one key: the second save finds it (has_block) and writes only its own."""
    import redis

    s = RedisKVStore(redis_url, max_bytes=10_000, max_age_s=60, prefix=prefix, clock=Clock())
    for session, keys in (("conv-a", ["sys-q", "a1-q"]), ("conv-b", ["sys-q", "b1-q"])):
        for k in keys:
            if not s.has_block(k):
                s.put_block(k, k.encode() * 10)
        s.put_manifest(session, ",".join(keys).encode())
    r = redis.Redis.from_url(redis_url)
    assert sorted(k.decode() for k in r.keys(prefix + "b:*")) == [prefix + "b:a1-q", prefix + "b:b1-q", prefix + "b:sys-q"]
    assert s.counters.bytes_written == 50 + 40 + 40 + 10 + 10  # "sys-q" x10 once; two 10-byte manifests


def test_eviction_by_size_is_least_recently_used_and_by_age(redis_url, prefix) -> None:
    clock = Clock()
    s = RedisKVStore(redis_url, max_bytes=250, max_age_s=60, prefix=prefix, clock=clock)
    s.put_block("k1-q", b"x" * 100)
    clock.t += 1
    s.put_block("k2-q", b"y" * 100)
    clock.t += 1
    assert s.get_block("k1-q") == b"x" * 100  # k1 is now the more recently used
    clock.t += 1
    s.put_block("k3-f", b"z" * 100)  # 300 > 250: the least recently used (k2) goes
    assert s.get_block("k2-q") is None
    assert s.get_block("k1-q") is not None and s.get_block("k3-f") is not None
    c = s.counters
    assert (c.evictions, c.entries, c.bytes, c.misses) == (1, 2, 200, 1)
    clock.t += 61  # 61 s later a manifest's save sweeps everything unused since
    s.put_manifest("conv-1", b"{}")
    assert s.evict() == []  # the put already did
    assert (s.counters.evictions, s.counters.entries, s.counters.bytes) == (3, 1, 2)
    assert s.get_block("k1-q") is None and s.get_manifest("conv-1") == b"{}"
    # An entry larger than the bound is kept (never the entry just written), and the next put evicts it.
    s.put_block("big-q", b"b" * 300)
    assert s.get_manifest("conv-1") is None and s.get_block("big-q") is not None
    clock.t += 1
    s.put_block("k4-q", b"4")
    assert s.get_block("big-q") is None and s.counters.bytes == 1


def test_the_server_clock_ages_entries_when_none_is_injected(redis_url, prefix) -> None:
    import time

    import redis

    s = RedisKVStore(redis_url, max_bytes=1000, max_age_s=0.3, prefix=prefix)
    s.put_block("old-q", b"o")
    score = redis.Redis.from_url(redis_url).zscore(prefix + "lru", "b:old-q")
    assert abs(score - time.time()) < 5  # the server's TIME, in seconds
    time.sleep(0.5)
    s.put_block("new-q", b"n")
    assert not s.has_block("old-q") and s.has_block("new-q")


def test_two_stores_on_one_server_see_and_bound_each_others_entries(redis_url, prefix) -> None:
    clock = Clock()
    a = RedisKVStore(redis_url, max_bytes=250, max_age_s=60, prefix=prefix, clock=clock)
    b = RedisKVStore(redis_url, max_bytes=250, max_age_s=60, prefix=prefix, clock=clock)
    other_app = RedisKVStore(redis_url, max_bytes=250, max_age_s=60, prefix=prefix + "other:", clock=clock)
    a.put_block("aa-q", b"1" * 100)
    clock.t += 1
    b.put_block("bb-q", b"2" * 100)
    clock.t += 1
    assert b.get_block("aa-q") == b"1" * 100  # written by the other store; now the more recently used
    assert other_app.get_block("aa-q") is None  # another prefix, another namespace
    clock.t += 1
    b.put_block("cc-q", b"3" * 100)  # 300 > 250 across both stores' entries: bb (t=1001) goes
    assert a.get_block("bb-q") is None and a.get_block("aa-q") is not None
    assert a.counters.misses == 1 and b.counters.evictions == 1


def test_batched_reads_are_one_round_trip_per_batch_and_refresh_use_times(redis_url, prefix, monkeypatch) -> None:
    """A restore's blocks in ceil(n / BATCH) script calls, in order, a missing one as None (counted as a
    miss); the save's question (which are missing) refreshes the stored ones' use times, and an entry whose
    value was deleted by hand leaves the books, as get_block does."""
    import redis

    from engine.memory import kv_store_redis

    monkeypatch.setattr(kv_store_redis, "BATCH", 3)
    clock = Clock()
    s = RedisKVStore(redis_url, max_bytes=10_000, max_age_s=600, prefix=prefix, clock=clock)
    keys = [f"k{i}-q" for i in range(7)]
    for i, k in enumerate(keys):
        if i != 4:
            s.put_block(k, bytes([i]) * (i + 1))
    r = redis.Redis.from_url(redis_url)
    r.delete(prefix + "b:k6-q")  # gone behind the store's back
    calls = []
    real = s._call
    monkeypatch.setattr(s, "_call", lambda script, *a: calls.append(script) or real(script, *a))
    clock.t = 1005.0
    got = s.get_blocks(keys)
    assert got == [bytes([i]) * (i + 1) for i in range(4)] + [None, b"\x05" * 6, None]
    assert len(calls) == 3  # 7 keys in batches of 3
    assert (s.counters.hits, s.counters.misses, s.counters.bytes_read) == (5, 2, 1 + 2 + 3 + 4 + 6)
    assert r.zscore(prefix + "lru", "b:k0-q") == 1005.0 and r.zscore(prefix + "lru", "b:k6-q") is None
    assert int(r.get(prefix + "bytes")) == sum(i + 1 for i in range(6) if i != 4)  # k6's 7 bytes left the books
    calls.clear()
    clock.t = 1010.0
    assert s.missing_blocks(keys) == [4, 6] and len(calls) == 3
    assert r.zscore(prefix + "lru", "b:k5-q") == 1010.0
    assert s.get_blocks([]) == [] and s.missing_blocks([]) == []


def test_tiered_batched_reads_take_what_redis_lacks_from_disk(redis_url, prefix, tmp_path) -> None:
    clock = Clock()
    small = RedisKVStore(redis_url, max_bytes=1000, max_age_s=60, prefix=prefix, clock=clock)
    t = TieredKVStore(small, DirectoryKVStore(str(tmp_path), 1000, 60, clock=clock), threshold=64)
    t.put_block("a-q", b"a" * 10)
    t.put_block("b-f", b"B" * 100)
    assert t.get_blocks(["a-q", "none-q", "b-f"]) == [b"a" * 10, None, b"B" * 100]
    assert t.missing_blocks(["b-f", "none-q", "a-q"]) == [1]
    c = t.counters
    assert (c.hits, c.misses) == (2, 1)  # Redis' probes for the large block and the missing one are not misses


def test_an_unreachable_server_raises_with_the_url_masked() -> None:
    s = RedisKVStore("redis://:hunter2@127.0.0.1:1/0", 100, 60, timeout_s=0.5)
    for call in (lambda: s.get_manifest("c"), lambda: s.put_block("k-q", b"x"), lambda: s.has_block("k-q"),
                 lambda: s.get_blocks(["k-q"]), lambda: s.missing_blocks(["k-q"])):
        with pytest.raises(KVStoreUnavailable, match=r"redis://\*\*\*@127.0.0.1:1/0") as e:
            call()
        assert "hunter2" not in str(e.value)


def test_tiered_keeps_small_entries_in_redis_and_large_blocks_on_disk(redis_url, prefix, tmp_path) -> None:
    import redis

    clock = Clock()
    small = RedisKVStore(redis_url, max_bytes=1000, max_age_s=60, prefix=prefix, clock=clock)
    t = TieredKVStore(small, DirectoryKVStore(str(tmp_path), 1000, 60, clock=clock), threshold=64)
    t.put_block("small-q", b"s" * 64)
    t.put_block("large-f", b"L" * 65)
    t.put_manifest("conv-1", b"{}")
    r = redis.Redis.from_url(redis_url)
    assert sorted(k.decode() for k in r.keys(prefix + "[bm]:*")) == [prefix + "b:small-q", prefix + "m:conv-1"]
    assert (tmp_path / "b" / "la" / "large-f").read_bytes() == b"L" * 65
    assert not list((tmp_path / "m").iterdir())
    assert t.get_block("small-q") == b"s" * 64 and t.get_block("large-f") == b"L" * 65
    assert t.has_block("large-f") and t.has_block("small-q") and not t.has_block("none-q")
    assert t.get_block("none-q") is None
    c = t.counters
    assert (c.bytes, c.entries, c.hits, c.misses, c.bytes_written) == (64 + 65 + 2, 3, 2, 1, 131)


def test_settings_choose_the_backend_and_name_the_bad_field(redis_url, prefix, tmp_path) -> None:
    assert isinstance(open_kv_store(SessionKV(path=str(tmp_path))), DirectoryKVStore)
    s = open_kv_store(session_kv_from_dict({"backend": "redis", "url": redis_url, "prefix": prefix}))
    assert isinstance(s, RedisKVStore) and s.prefix == prefix
    t = open_kv_store(SessionKV(backend="tiered", url=redis_url, path=str(tmp_path), small_block_bytes=4096))
    assert isinstance(t, TieredKVStore) and t.threshold == 4096
    for bad, field in (({"backend": "redis"}, "session_kv.url"), ({"backend": "tiered"}, "session_kv.url"),
                       ({"backend": "redis", "url": "http://h"}, "session_kv.url"),
                       ({"url": "redis://h:6379/0"}, "session_kv.url"), ({"backend": "s3"}, "session_kv.backend"),
                       ({"backend": "redis", "url": "redis://h", "prefix": ""}, "session_kv.prefix"),
                       ({"backend": "tiered", "url": "redis://h", "small_block_bytes": 0}, "session_kv.small_block_bytes"),
                       ({"backend": "redis", "url": "redis://h", "threshold": 1}, "session_kv.threshold")):
        with pytest.raises(ConfigError) as e:
            session_kv_from_dict(bad)
        assert e.value.field == field, (bad, e.value)
