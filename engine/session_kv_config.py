"""Session KV settings (``EngineConfig.session_kv``): where a conversation's KV blocks outlive the replica.

A finished turn of a request carrying a session id saves its full KV blocks (packed codes and scales
as they are, 16-bit blocks in 16 bits) to a content-addressed store on disk; a later turn of that
session restores them on whichever engine gets it, then prefills only what follows
(``engine/session_cache.py``). Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class SessionKV:
    """``enabled``: save and restore session KV. ``path``: the store's directory (shared by every
    replica that may serve the session: a local disk for one node, a shared mount for many).
    ``max_bytes``: the store's size bound; past it the least recently used entries go. ``max_age_s``:
    entries unused this long go (a session's turns are minutes apart; a day is generous)."""

    enabled: bool = False
    path: str = "~/.sinkserve/session_kv"
    max_bytes: int = 4 << 30
    max_age_s: float = 86400.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError("session_kv.max_bytes", f"must be >= 1, got {self.max_bytes}")
        if self.max_age_s <= 0:
            raise ConfigError("session_kv.max_age_s", f"must be > 0, got {self.max_age_s}")
        if not self.path:
            raise ConfigError("session_kv.path", "must name a directory")
