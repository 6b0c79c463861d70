"""Redis backend (``store: {kind: redis, url: redis://host:6379/0}``): for apps whose ingress
replicas run on more than one node. Keys carry a prefix so several apps can share one server.
Counters are ``SET NX EX`` + ``INCRBY`` in one MULTI block (the first increment starts the expiry);
queues are lists (``RPUSH`` / ``LPOP`` / ``LMOVE``, atomic on the server); an owner-checked delete
and a quota reservation are Lua scripts (one atomic step on the server); a guarded commit is
``WATCH`` + ``MULTI``. Errors and logs name the URL with its password masked."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence, TypeVar

from app.state.base import Incr, Limit, Put, StoreError
from engine.memory.urls import mask_url

T = TypeVar("T")

# KEYS[1]: the lock; ARGV[1]: its owner's token.
_DELETE_IF = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
# KEYS: counters; ARGV[1]: amount, then per counter its limit and ttl (ms). Returns {1|0, values...}.
_RESERVE = """
local amount = tonumber(ARGV[1])
local now = {}
local ok = 1
for i, k in ipairs(KEYS) do
  now[i] = tonumber(redis.call('get', k) or '0')
  if now[i] + amount > tonumber(ARGV[2 * i]) then ok = 0 end
end
if ok == 1 then
  for i, k in ipairs(KEYS) do
    redis.call('set', k, 0, 'PX', ARGV[2 * i + 1], 'NX')
    now[i] = redis.call('incrby', k, amount)
  end
end
table.insert(now, 1, ok)
return now
"""


class RedisStore:
    """A store on a Redis server; every error is re-raised as ``StoreError`` naming the URL."""

    kind = "redis"

    def __init__(self, url: str, prefix: str = "sinkserve:", client: Any = None, timeout_s: float = 2.0) -> None:
        import redis

        self.url = mask_url(url)  # only ever shown masked
        self.prefix = prefix
        self._errors = (redis.RedisError, OSError)
        # Short timeouts: an unreachable server must fail a readiness probe, not hang it.
        self.r = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _run(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as e:
            raise StoreError(f"redis store {self.url}: {e}", f"redis store unreachable ({type(e).__name__})") from e

    @staticmethod
    def _ms(ttl_s: float | None) -> int | None:
        return None if ttl_s is None else max(1, math.ceil(ttl_s * 1000))

    def get(self, key: str) -> bytes | None:
        return self._run(lambda: self.r.get(self._k(key)))

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._run(lambda: self.r.set(self._k(key), value, px=self._ms(ttl_s)))

    def put_if_absent(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        return bool(self._run(lambda: self.r.set(self._k(key), value, px=self._ms(ttl_s), nx=True)))

    def delete(self, key: str) -> bool:
        return bool(self._run(lambda: self.r.delete(self._k(key))))

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        def q() -> int:
            pipe = self.r.pipeline(transaction=True)
            pipe.set(self._k(key), 0, px=self._ms(ttl_s), nx=True)
            pipe.incrby(self._k(key), amount)
            return int(pipe.execute()[1])

        return self._run(q)

    def counter(self, key: str) -> int:
        v = self._run(lambda: self.r.get(self._k(key)))
        return int(v) if v is not None else 0

    def delete_if(self, key: str, value: bytes) -> bool:
        return bool(self._run(lambda: self.r.eval(_DELETE_IF, 1, self._k(key), value)))

    def reserve(self, limits: Sequence[Limit], amount: int) -> tuple[bool, list[int]]:
        if not limits:
            return True, []
        args: list[Any] = [amount]
        for _, limit, ttl_s in limits:
            args += [limit, self._ms(ttl_s)]
        out = self._run(lambda: self.r.eval(_RESERVE, len(limits), *[self._k(k) for k, _, _ in limits], *args))
        return bool(out[0]), [int(v) for v in out[1:]]

    def commit(self, puts: Sequence[Put] = (), incrs: Sequence[Incr] = (), deletes: Sequence[str] = (),
               pushes: Sequence[tuple[str, bytes]] = (), expect: tuple[str, bytes | None] | None = None) -> bool:
        import redis

        def q() -> bool:
            with self.r.pipeline(transaction=True) as pipe:
                try:
                    if expect is not None:
                        pipe.watch(self._k(expect[0]))
                        if pipe.get(self._k(expect[0])) != expect[1]:
                            return False
                        pipe.multi()
                    for key, value, ttl_s in puts:
                        pipe.set(self._k(key), value, px=self._ms(ttl_s))
                    for key, amount, ttl_s in incrs:
                        pipe.set(self._k(key), 0, px=self._ms(ttl_s), nx=True)
                        pipe.incrby(self._k(key), amount)
                    for key in deletes:
                        pipe.delete(self._k(key))
                    for queue, item in pushes:
                        pipe.rpush(self._k("queue:" + queue), item)
                    pipe.execute()
                    return True
                except redis.WatchError:  # the expected key changed meanwhile: nothing was written
                    return False

        return self._run(q)

    def move(self, src: str, dst: str) -> bytes | None:
        return self._run(lambda: self.r.lmove(self._k("queue:" + src), self._k("queue:" + dst), "LEFT", "RIGHT"))

    def purge_expired(self, limit: int = 1000) -> int:
        return 0  # Redis expires keys itself

    def push(self, queue: str, item: bytes) -> None:
        self._run(lambda: self.r.rpush(self._k("queue:" + queue), item))

    def pop(self, queue: str) -> bytes | None:
        return self._run(lambda: self.r.lpop(self._k("queue:" + queue)))

    def ping(self) -> None:
        def q() -> None:
            self.r.set(self._k("_ping"), b"\x00", px=60_000)
            self.r.get(self._k("_ping"))

        self._run(q)

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
