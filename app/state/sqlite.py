"""SQLite backend: one file under the data directory, WAL mode, shared by every process on the node.

WAL lets readers run beside the one writer; ``busy_timeout`` makes a writer wait for another
process's write instead of failing. Counters and queue pops run in ``BEGIN IMMEDIATE`` transactions
(the write lock is taken first), so two ingress replicas incrementing one counter never lose an
update; a guarded commit and a quota reservation check and write in one such transaction. Expiry
is wall-clock time (every process on the node shares the clock); expired rows are ignored on read
and deleted in bounded batches by :meth:`SQLiteStore.purge_expired`, which the ingress runs in the
background (``app/state/base.py``: :func:`purge_forever`).

SQLite is one file on one node: an app whose replicas span nodes must use Redis (``app/builder.py``
refuses SQLite there), or each node would keep its own conversations, quotas and jobs.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from app.state.base import Incr, Limit, Put, StoreError

logger = logging.getLogger("sinkserve.store")
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL, expires REAL);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, n INTEGER NOT NULL, expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS queue (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, item BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS queue_name ON queue (name, id);
CREATE INDEX IF NOT EXISTS kv_expires ON kv (expires);
CREATE INDEX IF NOT EXISTS counters_expires ON counters (expires);
"""


class SQLiteStore:
    """The embedded store (``store: {kind: sqlite, data_dir: ...}``): ``<data_dir>/sinkserve.sqlite3``."""

    kind = "sqlite"
    FILENAME = "sinkserve.sqlite3"

    def __init__(self, data_dir: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(data_dir).expanduser() / self.FILENAME
        self.clock = clock
        self._lock = threading.Lock()  # one connection, used from worker threads one at a time
        self._conn: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
                conn.executescript(SCHEMA)
            except sqlite3.Error:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            try:
                return fn(self._connect())
            except sqlite3.Error as e:
                # A corrupt file stays corrupt; drop the connection so a repaired file is reopened.
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                raise StoreError(f"sqlite store {self.path}: {e}", f"sqlite store unusable: {e}") from e

    def _tx(self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn.execute("BEGIN IMMEDIATE")
        try:
            out = fn(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return out

    def get(self, key: str) -> bytes | None:
        def q(c: sqlite3.Connection) -> bytes | None:
            row = c.execute("SELECT value, expires FROM kv WHERE key = ?", (key,)).fetchone()
            if row is None or (row[1] is not None and row[1] <= self.clock()):
                return None
            return bytes(row[0])

        return self._run(q)

    def _expiry(self, ttl_s: float | None) -> float | None:
        return None if ttl_s is None else self.clock() + ttl_s

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                                      (key, value, self._expiry(ttl_s))))

    def put_if_absent(self, key: str, value: bytes, ttl_s: float | None = None) -> bool:
        def q(c: sqlite3.Connection) -> bool:
            c.execute("DELETE FROM kv WHERE key = ? AND expires IS NOT NULL AND expires <= ?", (key, self.clock()))
            cur = c.execute("INSERT OR IGNORE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                            (key, value, self._expiry(ttl_s)))
            return cur.rowcount == 1

        return self._run(lambda c: self._tx(c, q))

    def delete(self, key: str) -> bool:
        return self._run(lambda c: c.execute("DELETE FROM kv WHERE key = ?", (key,)).rowcount == 1)

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        return self._run(lambda c: self._tx(c, lambda c: self._incr(c, key, amount, ttl_s, self.clock())))

    def counter(self, key: str) -> int:
        return self._run(lambda c: self._counter(c, key, self.clock()))

    def delete_if(self, key: str, value: bytes) -> bool:
        return self._run(lambda c: c.execute("DELETE FROM kv WHERE key = ? AND value = ?", (key, value)).rowcount == 1)

    def _counter(self, c: sqlite3.Connection, key: str, now: float) -> int:
        row = c.execute("SELECT n FROM counters WHERE key = ? AND expires > ?", (key, now)).fetchone()
        return int(row[0]) if row else 0

    def _incr(self, c: sqlite3.Connection, key: str, amount: int, ttl_s: float, now: float) -> int:
        c.execute("DELETE FROM counters WHERE key = ? AND expires <= ?", (key, now))
        c.execute("INSERT INTO counters (key, n, expires) VALUES (?, ?, ?) "
                  "ON CONFLICT (key) DO UPDATE SET n = n + excluded.n", (key, amount, now + ttl_s))
        return int(c.execute("SELECT n FROM counters WHERE key = ?", (key,)).fetchone()[0])

    def reserve(self, limits: Sequence[Limit], amount: int) -> tuple[bool, list[int]]:
        def q(c: sqlite3.Connection) -> tuple[bool, list[int]]:
            now = self.clock()
            values = [self._counter(c, key, now) for key, _, _ in limits]
            if any(v + amount > limit for v, (_, limit, _) in zip(values, limits)):
                return False, values
            return True, [self._incr(c, key, amount, ttl_s, now) for key, _, ttl_s in limits]

        return self._run(lambda c: self._tx(c, q))

    def commit(self, puts: Sequence[Put] = (), incrs: Sequence[Incr] = (), deletes: Sequence[str] = (),
               pushes: Sequence[tuple[str, bytes]] = (), expect: tuple[str, bytes | None] | None = None) -> bool:
        def q(c: sqlite3.Connection) -> bool:
            now = self.clock()
            if expect is not None:
                row = c.execute("SELECT value FROM kv WHERE key = ? AND (expires IS NULL OR expires > ?)",
                                (expect[0], now)).fetchone()
                if (bytes(row[0]) if row else None) != expect[1]:
                    return False
            for key, value, ttl_s in puts:
                c.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)", (key, value, self._expiry(ttl_s)))
            for key, amount, ttl_s in incrs:
                self._incr(c, key, amount, ttl_s, now)
            for key in deletes:
                c.execute("DELETE FROM kv WHERE key = ?", (key,))
            for queue, item in pushes:
                c.execute("INSERT INTO queue (name, item) VALUES (?, ?)", (queue, item))
            return True

        return self._run(lambda c: self._tx(c, q))

    def move(self, src: str, dst: str) -> bytes | None:
        def q(c: sqlite3.Connection) -> bytes | None:
            row = c.execute("SELECT id, item FROM queue WHERE name = ? ORDER BY id LIMIT 1", (src,)).fetchone()
            if row is None:
                return None
            c.execute("DELETE FROM queue WHERE id = ?", (row[0],))
            c.execute("INSERT INTO queue (name, item) VALUES (?, ?)", (dst, row[1]))
            return bytes(row[1])

        return self._run(lambda c: self._tx(c, q))

    def purge_expired(self, limit: int = 1000) -> int:
        def q(c: sqlite3.Connection) -> int:
            now = self.clock()
            n = c.execute("DELETE FROM kv WHERE rowid IN (SELECT rowid FROM kv WHERE expires <= ? LIMIT ?)",
                          (now, limit)).rowcount
            return n + c.execute("DELETE FROM counters WHERE rowid IN (SELECT rowid FROM counters WHERE expires <= ? LIMIT ?)",
                                 (now, limit)).rowcount

        return self._run(q)

    def push(self, queue: str, item: bytes) -> None:
        self._run(lambda c: c.execute("INSERT INTO queue (name, item) VALUES (?, ?)", (queue, item)))

    def pop(self, queue: str) -> bytes | None:
        def q(c: sqlite3.Connection) -> bytes | None:
            row = c.execute("SELECT id, item FROM queue WHERE name = ? ORDER BY id LIMIT 1", (queue,)).fetchone()
            if row is None:
                return None
            c.execute("DELETE FROM queue WHERE id = ?", (row[0],))
            return bytes(row[1])

        return self._run(lambda c: self._tx(c, q))

    def ping(self) -> None:
        def q(c: sqlite3.Connection) -> Any:
            # A write and a read of one row: cheap however many rows the store holds (no count(*)).
            c.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES ('_ping', x'00', ?)", (self.clock() + 60,))
            return c.execute("SELECT value FROM kv WHERE key = '_ping'").fetchone()

        self._run(q)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
