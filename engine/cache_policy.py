"""The cache (retention) policy: which tokens are protected and how much recent context is kept.

Frozen inside the engine; the serving layer builds it from pydantic config. The policy has a version
string derived from its contents, so logs and metrics show which policy produced a result and a
rollback is "apply the previous config again".

Layout of one sequence's cache under ``sliding_window`` (block granular, block_size 4, window 8)::

    logical blocks:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ]
    kept:             sink  --evicted--  anchor [ window  ]
    block table:     [ 7 ][ 0 ][ 0 ][ 12][ 0 ][ 3 ][ 9 ]     0 = null block, skipped by kernels
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

from engine.errors import ConfigError

EvictionPolicy = Literal["none", "sliding_window"]
TOKEN_ROLES = ("sink", "delimiter", "system", "session_start")


@dataclass(frozen=True)
class CachePolicy:
    """Retention settings. ``protected_positions`` are the sinks (absolute token positions)."""

    eviction_policy: EvictionPolicy = "none"
    window: int = 1024
    protected_positions: tuple[int, ...] = (0, 1, 2, 3)
    protected_token_roles: tuple[str, ...] = ("sink",)
    max_protected_tokens: int = 512
    max_stream_tokens: int = 1 << 20
    # High-precision set of a quantized KV cache (EngineConfig.kv_cache_dtype != "auto"): blocks holding a
    # protected token stay 16-bit, and so do the blocks holding the newest ``residual_window`` computed
    # tokens (KIVI's residual). Every other block is quantized once, when it is full and leaves the
    # residual window. Ignored when the cache is not quantized.
    residual_window: int = 128
    keep_protected_16bit: bool = True

    def validate(self, block_size: int) -> None:
        """Raise ``ConfigError`` naming the field if the policy cannot work."""
        if self.eviction_policy not in ("none", "sliding_window"):
            raise ConfigError("eviction_policy", f"must be 'none' or 'sliding_window', got {self.eviction_policy!r}")
        if self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")
        if self.eviction_policy == "sliding_window" and self.window < block_size:
            raise ConfigError("window", f"window {self.window} is smaller than block_size {block_size}")
        if any(p < 0 for p in self.protected_positions):
            raise ConfigError("protected_positions", "positions must be >= 0")
        unknown = [r for r in self.protected_token_roles if r not in TOKEN_ROLES]
        if unknown:
            raise ConfigError("protected_token_roles", f"unknown roles {unknown}; choose from {list(TOKEN_ROLES)}")
        if len(set(self.protected_positions)) > self.max_protected_tokens:
            raise ConfigError(
                "protected_positions",
                f"{len(set(self.protected_positions))} protected positions exceed max_protected_tokens="
                f"{self.max_protected_tokens}",
            )
        if self.max_stream_tokens < 1:
            raise ConfigError("max_stream_tokens", "must be >= 1")
        if self.residual_window < 0:
            raise ConfigError("residual_window", f"must be >= 0 (0: no residual window), got {self.residual_window}")

    @property
    def evicts(self) -> bool:
        return self.eviction_policy == "sliding_window"

    @property
    def version(self) -> str:
        """Short content hash: equal policies have equal versions, so re-applying a config rolls back."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def describe(self) -> str:
        """One line for the start-up log."""
        pos = list(self.protected_positions)
        span = f"[{pos[0]}..{pos[-1]}]" if pos and pos == list(range(pos[0], pos[-1] + 1)) else str(pos)
        return (
            f"protection set active: positions {span}, roles {list(self.protected_token_roles)}, "
            f"eviction {self.eviction_policy}, window {self.window}, 16-bit when quantized: "
            f"{'protected blocks + ' if self.keep_protected_16bit else ''}residual {self.residual_window} tokens, "
            f"version {self.version}"
        )
