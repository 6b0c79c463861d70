"""Redis backend (``store: {kind: redis, url: redis://host:6379/0}``): for apps whose ingress
replicas run on more than one node. Keys carry a prefix so several apps can share one server.
Counters are ``SET NX EX`` + ``INCRBY`` in one MULTI block (the first increment starts the expiry);
queues are lists (``RPUSH`` / ``LPOP``, atomic on the server)."""

from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

from app.store.base import StoreError

T = TypeVar("T")


class RedisStore:
    """A store on a Redis server; every error is re-raised as ``StoreError`` naming the URL."""

    kind = "redis"

    def __init__(self, url: str, prefix: str = "sinkserve:", client: Any = None, timeout_s: float = 2.0) -> None:
        import redis

        self.url = url
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
            raise StoreError(f"redis store {self.url}: {e}") from e

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
