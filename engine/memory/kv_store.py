"""The session KV store: named byte blobs on disk, bounded in size, the least recently used evicted.

Pure Python (no torch). Two kinds of entry share one directory and one bound::

    <path>/b/3f/3f9a...-q      a KV block (content-addressed: the key names what it holds)
    <path>/m/conv-42.json      a session's manifest (which blocks, its retention state)

Several engines (replicas, processes, nodes on a shared mount) may use one directory: writes go to a
temporary file then ``os.replace``, so a reader sees a whole entry or none; a use ``touch``-es the
file's mtime, which is the entry's age. Each store keeps an ``EvictionIndex`` of what it knows; when
a put takes it past ``max_bytes`` it re-reads the directory (other writers' entries count too) and
deletes the oldest entries until it is back under the bound; entries older than ``max_age_s`` go
at the same time. Example (``max_bytes=10``)::

    put a (4 B, t=1), put b (4 B, t=2), get a (t=3), put c (4 B, t=4)  -> 12 B > 10: evict b
                                                                          (a was used at t=3)
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@dataclass
class KVStoreCounters:
    """What the store did since it opened (bytes / entries are gauges of the whole directory as last seen)."""

    bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class KVStoreUnavailable(RuntimeError):
    """The store could not be reached (a Redis server down, a timeout): the turn re-prefills, the
    message says which store (never its password)."""


@runtime_checkable
class KVStore(Protocol):
    """What ``engine/memory/session_cache.py`` needs of a store (directory, Redis, or both tiered).

    Blocks are named by their content key (``engine/memory/session_kv.py``), manifests by their session. A
    read or ``has_block`` counts as a use (the least recently used entries are evicted first).
    Reading a missing entry gives ``None``; a store that cannot be reached raises
    ``KVStoreUnavailable``."""

    counters: KVStoreCounters
    where: str  # for logs: the directory, or the URL with its password masked

    def has_block(self, key: str) -> bool: ...

    def get_block(self, key: str) -> bytes | None: ...

    def get_blocks(self, keys: list[str]) -> list[bytes | None]:
        """``get_block`` of each key, in order (a network store reads them in few round trips)."""
        ...

    def missing_blocks(self, keys: list[str]) -> list[int]:
        """Indices of ``keys`` whose blocks are not stored (the others count as used, as ``has_block``)."""
        ...

    def put_block(self, key: str, data: bytes) -> None: ...

    def get_manifest(self, session: str) -> bytes | None: ...

    def put_manifest(self, session: str, data: bytes) -> None: ...

    def evict(self, keep: frozenset[str] = frozenset()) -> list[str]: ...


class EvictionIndex:
    """Entries with their size and last use; which to evict for a size bound and an age limit.

    >>> ix = EvictionIndex()
    >>> ix.add("a", 4, 1.0); ix.add("b", 4, 2.0); ix.touch("a", 3.0); ix.add("c", 4, 4.0)
    >>> ix.victims(now=4.0, max_bytes=10, max_age_s=100.0)
    ['b']
    >>> ix.victims(now=103.5, max_bytes=100, max_age_s=100.0)   # b (t=2) and a (t=3) are too old
    ['b', 'a']
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, float]] = {}
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def add(self, key: str, size: int, at: float) -> None:
        self.remove(key)
        self._entries[key] = (size, at)
        self.total_bytes += size

    def touch(self, key: str, at: float) -> None:
        if key in self._entries:
            self._entries[key] = (self._entries[key][0], at)

    def remove(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[0]

    def victims(self, now: float, max_bytes: int, max_age_s: float, keep: frozenset[str] = frozenset()) -> list[str]:
        """Keys to delete, oldest first: every entry unused for more than ``max_age_s``, then the oldest
        others until the rest fit ``max_bytes``. ``keep`` (the entries being written) is never chosen."""
        order = sorted((at, key) for key, (_, at) in self._entries.items() if key not in keep)
        out: list[str] = []
        total = self.total_bytes
        for at, key in order:
            if now - at > max_age_s or total > max_bytes:
                out.append(key)
                total -= self._entries[key][0]
            else:
                break
        return out


def safe_key(key: str) -> str:
    """``key`` if it is a valid entry name (no path separator, no leading dot, no NUL), else ``ValueError``."""
    if not key or "/" in key or key.startswith(".") or "\x00" in key:
        raise ValueError(f"bad store key {key!r}")
    return key


class DirectoryKVStore:
    """The store on a directory (see the module docstring)."""

    def __init__(self, path: str, max_bytes: int, max_age_s: float, clock=time.time) -> None:
        self.root = Path(os.path.expanduser(path))
        self.where = str(self.root)
        (self.root / "b").mkdir(parents=True, exist_ok=True)
        (self.root / "m").mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock = clock
        self.index = EvictionIndex()
        self.counters = KVStoreCounters()
        self.rescan()

    # ---- paths
    def _block_path(self, key: str) -> Path:
        key = safe_key(key)
        return self.root / "b" / key[:2] / key

    def _manifest_path(self, session: str) -> Path:
        return self.root / "m" / (safe_key(session) + ".json")

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    # ---- blocks
    def has_block(self, key: str) -> bool:
        """Whether the block is stored (its age is refreshed: a turn that re-saves it still uses it)."""
        path = self._block_path(key)
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        self.index.touch(self._rel(path), self.clock())
        return True

    def get_block(self, key: str) -> bytes | None:
        return self._get(self._block_path(key))

    def get_blocks(self, keys: list[str]) -> list[bytes | None]:
        return [self.get_block(k) for k in keys]

    def missing_blocks(self, keys: list[str]) -> list[int]:
        return [i for i, k in enumerate(keys) if not self.has_block(k)]

    def put_block(self, key: str, data: bytes) -> None:
        self._put(self._block_path(key), data)

    # ---- manifests
    def get_manifest(self, session: str) -> bytes | None:
        return self._get(self._manifest_path(session))

    def put_manifest(self, session: str, data: bytes) -> None:
        self._put(self._manifest_path(session), data)

    # ---- the bound
    def rescan(self) -> None:
        """Rebuild the index from the directory (other writers' entries included)."""
        self.index = EvictionIndex()
        for sub in ("b", "m"):
            for dirpath, _, files in os.walk(self.root / sub):
                for name in files:
                    if name.startswith("."):
                        continue  # a writer's temporary file
                    p = Path(dirpath) / name
                    try:
                        st = p.stat()
                    except FileNotFoundError:
                        continue
                    self.index.add(self._rel(p), st.st_size, st.st_mtime)
        self._gauges()

    def evict(self, keep: frozenset[str] = frozenset()) -> list[str]:
        """Delete what is too old or past the size bound (relative paths, oldest first)."""
        gone = self.index.victims(self.clock(), self.max_bytes, self.max_age_s, keep)
        for rel in gone:
            try:
                (self.root / rel).unlink()
            except FileNotFoundError:
                pass
            self.index.remove(rel)
        if gone:
            self.counters.evictions += len(gone)
            logger.info("session KV store: evicted %d entries (%d bytes left of %d)", len(gone),
                        self.index.total_bytes, self.max_bytes)
        self._gauges()
        return gone

    # ---- internals
    def _get(self, path: Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.counters.misses += 1
            self.index.remove(self._rel(path))
            return None
        now = self.clock()
        try:
            os.utime(path, (now, now))
        except FileNotFoundError:
            pass
        rel = self._rel(path)
        if rel in self.index:
            self.index.touch(rel, now)
        else:  # another writer's entry: it counts against the bound from now on
            self.index.add(rel, len(data), now)
        self.counters.hits += 1
        self.counters.bytes_read += len(data)
        return data

    def _put(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            now = self.clock()
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        rel = self._rel(path)
        self.index.add(rel, len(data), self.clock())
        self.counters.bytes_written += len(data)
        if self.index.total_bytes > self.max_bytes:
            self.rescan()  # other writers' entries count against the same bound
            self.evict(keep=frozenset({rel}))
        self._gauges()

    def _gauges(self) -> None:
        self.counters.bytes = self.index.total_bytes
        self.counters.entries = len(self.index)
