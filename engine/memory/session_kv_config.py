"""Session KV settings (``EngineConfig.session_kv``): where a conversation's KV blocks outlive the replica.

A finished turn of a request carrying a session id saves its full KV blocks (packed codes and scales
as they are, 16-bit blocks in 16 bits) to a content-addressed store; a later turn of that session
restores them on whichever engine gets it, then prefills only what follows
(``engine/memory/session_cache.py``). Pure Python: no torch.

The store's backend (``engine/kv_store_open.py``)::

    directory   every entry a file under ``path``               one node, or a shared mount
    redis       every entry a value on the server at ``url``    several nodes, no shared mount
    tiered      manifests + blocks <= small_block_bytes in Redis, larger blocks under ``path``
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

BACKENDS = ("directory", "redis", "tiered")
URL_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class SessionKV:
    """``enabled``: save and restore session KV. ``backend``: ``directory``, ``redis`` or ``tiered``
    (module docstring). ``path``: the directory (``directory``, ``tiered``; shared by every replica
    that may serve the session: a local disk for one node, a shared mount for many). ``url``: the
    Redis server (``redis``, ``tiered``), ``prefix`` namespacing its keys (several apps may share one
    server). ``small_block_bytes``: with ``tiered``, blocks up to this size go to Redis.
    ``max_bytes``: the size bound (of each store with ``tiered``); past it the least recently used
    entries go. ``max_age_s``: entries unused this long go (a session's turns are minutes apart; a
    day is generous)."""

    enabled: bool = False
    backend: str = "directory"
    path: str = "~/.sinkserve/session_kv"
    url: str | None = None
    prefix: str = "sinkserve:kv:"
    small_block_bytes: int = 512 << 10
    max_bytes: int = 4 << 30
    max_age_s: float = 86400.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("session_kv.backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.max_bytes < 1:
            raise ConfigError("session_kv.max_bytes", f"must be >= 1, got {self.max_bytes}")
        if self.max_age_s <= 0:
            raise ConfigError("session_kv.max_age_s", f"must be > 0, got {self.max_age_s}")
        if self.backend in ("directory", "tiered") and not self.path:
            raise ConfigError("session_kv.path", "must name a directory")
        if self.backend == "directory":
            if self.url is not None:
                raise ConfigError("session_kv.url", "only with backend redis or tiered (the directory backend has no server)")
        elif not self.url:
            raise ConfigError("session_kv.url", f"backend {self.backend} needs the Redis server's URL (redis://host:6379/0)")
        elif not self.url.startswith(URL_SCHEMES):
            raise ConfigError("session_kv.url", f"must start with {', '.join(URL_SCHEMES)}")
        if not self.prefix:
            raise ConfigError("session_kv.prefix", "must not be empty (it keeps apps sharing one Redis apart)")
        if self.small_block_bytes < 1:
            raise ConfigError("session_kv.small_block_bytes", f"must be >= 1, got {self.small_block_bytes}")
