"""The session KV store on a Redis server: the same entries as the directory store, for engines on
several nodes that share no disk.

Pure Python (no torch). Keys, with ``prefix`` (default ``sinkserve:kv:``) keeping apps apart::

    <prefix>b:3f9a...-q     a KV block (content-addressed: a prefix shared by sessions is one key)
    <prefix>m:conv-42       a session's manifest
    <prefix>lru             sorted set: entry ("b:3f9a...-q", "m:conv-42") -> last use (s)
    <prefix>size            hash: entry -> bytes
    <prefix>bytes           the sum of those sizes

Every operation is one Lua script, so it is atomic on the server: several engines (replicas on
several nodes) sharing one Redis never see a half-written entry, never double-count a size, and the
eviction a put triggers sees every engine's entries. A put writes the value, its size and its use
time, then deletes entries unused for more than ``max_age_s`` and the least recently used others
until the total is back under ``max_bytes`` (never the entry it wrote). Example (``max_bytes=10``)::

    put b:a (4 B, t=1), put b:b (4 B, t=2), get b:a (t=3), put b:c (4 B, t=4)
      -> bytes 12 > 10: the oldest in lru is b:b (a was used at t=3): del <prefix>b:b, bytes 8

Time is the server's (``TIME``), so engines with skewed clocks agree on ages; tests inject a clock.
Entry keys are built inside the scripts, so the store needs one Redis server (not Redis Cluster).
A server that cannot be reached raises ``KVStoreUnavailable`` naming the URL with its password masked:
the session turn re-prefills (``engine/memory/session_cache.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.memory.kv_store import KVStoreCounters, KVStoreUnavailable, safe_key
from engine.memory.urls import mask_url

logger = logging.getLogger(__name__)

# KEYS: lru, size, bytes. ARGV[1]: now (s; negative: the server's TIME), ARGV[2]: max_bytes, ARGV[3]:
# max_age_s, ARGV[4]: prefix, then the script's own arguments from ARGV[5].
_HEAD = """
local now = tonumber(ARGV[1])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local prefix = ARGV[4]
local function drop(e)
  local sz = tonumber(redis.call('hget', KEYS[2], e) or '0')
  redis.call('del', prefix .. e)
  redis.call('zrem', KEYS[1], e)
  redis.call('hdel', KEYS[2], e)
  return redis.call('incrby', KEYS[3], -sz)
end
-- Entries unused for more than max_age, then the least recently used until the total fits; never keep.
local function evict(keep)
  local max_bytes, max_age = tonumber(ARGV[2]), tonumber(ARGV[3])
  local total = tonumber(redis.call('get', KEYS[3]) or '0')
  local gone = {}
  local i = 0
  while true do
    local first = redis.call('zrange', KEYS[1], i, i, 'WITHSCORES')
    if #first == 0 then break end
    local e, at = first[1], tonumber(first[2])
    if e == keep then
      i = i + 1
    elseif now - at > max_age or total > max_bytes then
      total = drop(e)
      table.insert(gone, e)
    else
      break
    end
  end
  return gone
end
local function gauges(gone)
  return {tonumber(redis.call('get', KEYS[3]) or '0'), redis.call('zcard', KEYS[1]), gone}
end
"""
# ARGV[5]: entry, ARGV[6]: value. Returns {bytes, entries, evicted entries}.
_PUT = _HEAD + """
local e = ARGV[5]
local old = tonumber(redis.call('hget', KEYS[2], e) or '0')
redis.call('set', prefix .. e, ARGV[6])
redis.call('hset', KEYS[2], e, #ARGV[6])
redis.call('zadd', KEYS[1], now, e)
redis.call('incrby', KEYS[3], #ARGV[6] - old)
return gauges(evict(e))
"""
# ARGV[5]: entry, ARGV[6]: "1" to return the value, "0" for whether it exists. A use refreshes its time;
# an entry whose value is gone (deleted by hand, Redis maxmemory) leaves the books.
_GET = _HEAD + """
local e = ARGV[5]
local v = redis.call('get', prefix .. e)
if v then
  redis.call('zadd', KEYS[1], 'XX', now, e)
  if ARGV[6] == '1' then return v end
  return 1
end
if redis.call('zscore', KEYS[1], e) then drop(e) end
if ARGV[6] == '1' then return false end
return 0
"""
# ARGV[5]: "1" to return the values, "0" for whether each exists; ARGV[6..]: entries. One reply for many
# entries (a turn's restore reads all its blocks, its save asks which are stored): each entry as _GET.
_GET_MANY = _HEAD + """
local out = {}
for i = 6, #ARGV do
  local e = ARGV[i]
  local v = redis.call('get', prefix .. e)
  if v then
    redis.call('zadd', KEYS[1], 'XX', now, e)
    if ARGV[5] == '1' then out[i - 5] = v else out[i - 5] = 1 end
  else
    if redis.call('zscore', KEYS[1], e) then drop(e) end
    out[i - 5] = false
  end
end
return out
"""
_EVICT = _HEAD + """
return gauges(evict(''))
"""
BATCH = 32  # entries per _GET_MANY call: a reply holds at most this many blocks (a few MiB on a real model)


class RedisKVStore:
    """The store on a Redis server (see the module docstring). ``clock``: seconds, for tests; None uses
    the server's ``TIME``. ``client``: a ``redis.Redis`` to use instead of one opened from ``url``."""

    def __init__(self, url: str, max_bytes: int, max_age_s: float, prefix: str = "sinkserve:kv:",
                 clock: Callable[[], float] | None = None, client: Any = None, timeout_s: float = 2.0) -> None:
        import redis

        self.where = mask_url(url)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self.counters = KVStoreCounters()
        self._errors = (redis.RedisError, OSError)
        # Short timeouts: a server that went away must fail a turn's restore quickly (it re-prefills), not hang it.
        self.r = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._put = self.r.register_script(_PUT)
        self._get = self.r.register_script(_GET)
        self._get_many = self.r.register_script(_GET_MANY)
        self._evict = self.r.register_script(_EVICT)
        self._keys = [prefix + "lru", prefix + "size", prefix + "bytes"]

    def key(self, entry: str) -> str:
        """The Redis key holding ``entry`` ("b:<block key>" or "m:<session>")."""
        return self.prefix + entry

    def _call(self, script: Any, *args: Any) -> Any:
        now = self.clock() if self.clock is not None else -1.0
        try:
            return script(keys=self._keys, args=[repr(float(now)), self.max_bytes, repr(float(self.max_age_s)),
                                                 self.prefix, *args])
        except self._errors as e:
            raise KVStoreUnavailable(f"session KV store {self.where}: {type(e).__name__}: {e}") from None

    def _gauges(self, res: list) -> list[str]:
        self.counters.bytes, self.counters.entries = int(res[0]), int(res[1])
        gone = [g.decode() if isinstance(g, bytes) else g for g in res[2]]
        if gone:
            self.counters.evictions += len(gone)
            logger.info("session KV store %s: evicted %d entries (%d bytes left of %d)", self.where, len(gone),
                        self.counters.bytes, self.max_bytes)
        return gone

    def _read(self, entry: str) -> bytes | None:
        data = self._call(self._get, entry, "1")
        if data is None:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self.counters.bytes_read += len(data)
        return data

    def _write(self, entry: str, data: bytes) -> None:
        self._gauges(self._call(self._put, entry, data))
        self.counters.bytes_written += len(data)

    # ---- blocks
    def has_block(self, key: str) -> bool:
        """Whether the block is stored (its use time is refreshed: a turn that re-saves it still uses it)."""
        return bool(self._call(self._get, "b:" + safe_key(key), "0"))

    def get_block(self, key: str) -> bytes | None:
        return self._read("b:" + safe_key(key))

    def get_blocks(self, keys: list[str]) -> list[bytes | None]:
        """``get_block`` of each key, ``BATCH`` keys per round trip (a restore's blocks, not one call each)."""
        out: list[bytes | None] = []
        for i in range(0, len(keys), BATCH):
            got = self._call(self._get_many, "1", *("b:" + safe_key(k) for k in keys[i : i + BATCH]))
            for data in got:
                if data is None:
                    self.counters.misses += 1
                else:
                    self.counters.hits += 1
                    self.counters.bytes_read += len(data)
                out.append(data)
        return out

    def missing_blocks(self, keys: list[str]) -> list[int]:
        """Indices of the keys not stored (the stored ones' use times refreshed), ``BATCH`` per round trip."""
        found: list[bool] = []
        for i in range(0, len(keys), BATCH):
            found += [bool(x) for x in self._call(self._get_many, "0",
                                                  *("b:" + safe_key(k) for k in keys[i : i + BATCH]))]
        return [i for i, ok in enumerate(found) if not ok]

    def put_block(self, key: str, data: bytes) -> None:
        self._write("b:" + safe_key(key), data)

    # ---- manifests
    def get_manifest(self, session: str) -> bytes | None:
        return self._read("m:" + safe_key(session))

    def put_manifest(self, session: str, data: bytes) -> None:
        self._write("m:" + safe_key(session), data)

    # ---- the bound
    def evict(self, keep: frozenset[str] = frozenset()) -> list[str]:
        """Delete what is too old or past the size bound (entries, oldest first). Each put already keeps
        the bound; ``keep`` is accepted for the interface (a put never evicts its own entry)."""
        return self._gauges(self._call(self._evict))
