"""The tiered session KV store, and the one place a ``SessionKV`` setting becomes a store.

Pure Python (no torch). ``backend: tiered`` puts manifests and blocks of at most
``small_block_bytes`` in Redis, larger blocks in the directory -- because Redis holds every value in
RAM and copies it on its single thread, so it serves many small entries fast but a multi-megabyte
16-bit block would cost it memory and stall other engines' calls, while a file costs the same per
byte at any size. Worked example (SmolLM2-135M, int4 KV, blocks of 64 tokens, threshold 512 KiB)::

    m:conv-42                       2 KB   -> Redis
    b:3f9a...-q  packed int4 block ~0.45 MB -> Redis
    b:77c0...-f  16-bit sink block  1.5 MB  -> <path>/b/77/77c0...-f

A block is read from Redis first, then from the directory (its key does not say its size); each
tier keeps its own ``max_bytes`` and ``max_age_s`` bound.
"""

from __future__ import annotations

from engine.memory.kv_store import DirectoryKVStore, KVStore, KVStoreCounters
from engine.memory.kv_store_redis import RedisKVStore
from engine.memory.session_kv_config import SessionKV


class TieredKVStore:
    """Small entries in ``small`` (Redis), blocks above ``threshold`` bytes in ``large`` (a directory)."""

    def __init__(self, small: KVStore, large: KVStore, threshold: int) -> None:
        self.small = small
        self.large = large
        self.threshold = threshold
        self.where = f"{small.where} (entries <= {threshold} B) + {large.where}"

    @property
    def counters(self) -> KVStoreCounters:
        a, b = self.small.counters, self.large.counters
        return KVStoreCounters(*(x + y for x, y in zip(vars(a).values(), vars(b).values())))

    def _tier(self, data: bytes) -> KVStore:
        return self.small if len(data) <= self.threshold else self.large

    def has_block(self, key: str) -> bool:
        return self.small.has_block(key) or self.large.has_block(key)

    def get_block(self, key: str) -> bytes | None:
        data = self.small.get_block(key)
        if data is None:
            self.small.counters.misses -= 1  # a probe: a large block was never in Redis (the miss is the directory's)
            data = self.large.get_block(key)
        return data

    def get_blocks(self, keys: list[str]) -> list[bytes | None]:
        """Redis first in batches; the keys it lacks (large blocks) from the directory."""
        out = self.small.get_blocks(keys)
        probe = [i for i, d in enumerate(out) if d is None]
        self.small.counters.misses -= len(probe)  # probes, as in get_block
        for i, data in zip(probe, self.large.get_blocks([keys[i] for i in probe])):
            out[i] = data
        return out

    def missing_blocks(self, keys: list[str]) -> list[int]:
        probe = self.small.missing_blocks(keys)
        return [probe[j] for j in self.large.missing_blocks([keys[i] for i in probe])]

    def put_block(self, key: str, data: bytes) -> None:
        self._tier(data).put_block(key, data)

    def get_manifest(self, session: str) -> bytes | None:
        return self.small.get_manifest(session)

    def put_manifest(self, session: str, data: bytes) -> None:
        self.small.put_manifest(session, data)

    def evict(self, keep: frozenset[str] = frozenset()) -> list[str]:
        return self.small.evict(keep) + self.large.evict(keep)


def open_kv_store(config: SessionKV) -> KVStore:
    """The store ``config.backend`` names (``engine/memory/session_kv_config.py``)."""
    if config.backend == "directory":
        return DirectoryKVStore(config.path, config.max_bytes, config.max_age_s)
    redis = RedisKVStore(config.url or "", config.max_bytes, config.max_age_s, prefix=config.prefix)
    if config.backend == "redis":
        return redis
    return TieredKVStore(redis, DirectoryKVStore(config.path, config.max_bytes, config.max_age_s),
                         config.small_block_bytes)
