"""The cache (retention) policy: which tokens are protected and how much recent context is kept.

Frozen inside the engine; the serving layer builds it from pydantic config. The policy has a version
string derived from its contents, so logs and metrics show which policy produced a result and a
rollback is "apply the previous config again".

Layout of one sequence's cache under ``sliding_window`` (block granular, block_size 4, window 8)::

    logical blocks:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ]
    kept:             sink  --evicted--  anchor [ window  ]
    block table:     [ 7 ][ 0 ][ 0 ][ 12][ 0 ][ 3 ][ 9 ]     0 = null block, skipped by kernels

Under ``importance`` a sequence holds at most ``block_budget`` blocks: when it holds more, the blocks
outside the protection set and the window with the lowest running attention score (a decayed sum:
``engine.memory.retention.IMPORTANCE_DECAY``) go first (block granular, see ``engine/memory/retention.py``; block_size 4, window 8, block_budget 5)::

    logical blocks:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ]
    importance:       sink  0.9  0.1  0.4  0.2 [ window  ]
    kept:             sink  kept --ev-- kept --ev-- [window]   held 7 > 5: evict the 2 lowest of {1..4}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

from engine.errors import ConfigError

EvictionPolicy = Literal["none", "sliding_window", "importance"]
EVICTION_POLICIES = ("none", "sliding_window", "importance")
TOKEN_ROLES = ("sink", "delimiter", "system", "session_start")


@dataclass(frozen=True)
class CachePolicy:
    """Retention settings. ``protected_positions`` are the sinks (absolute token positions).

    ``window`` None: derived from the model (``engine/limits.py``): the full cache inside the trained
    context, then the newest ``ctx - chunk - 2 blocks`` tokens."""

    eviction_policy: EvictionPolicy = "none"
    window: int | None = None
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
    # ``importance`` only: blocks one sequence may hold (protected blocks and the window included; a
    # request's ``sinkserve.kv_budget_blocks`` may lower it). A step's new blocks come on top until the
    # next step evicts, so a decoding sequence holds at most ``block_budget + 1`` blocks.
    block_budget: int = 64

    def validate(self, block_size: int) -> None:
        """Raise ``ConfigError`` naming the field if the policy cannot work."""
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError("eviction_policy", f"must be one of {list(EVICTION_POLICIES)}, got {self.eviction_policy!r}")
        if self.window is not None and self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")
        if self.evicts and self.window is not None and self.window < block_size:
            raise ConfigError("window", f"window {self.window} is smaller than block_size {block_size}")
        if self.eviction_policy == "importance" and self.window is not None:
            check_block_budget(self.block_budget, self.window, block_size, "block_budget")
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
        return self.eviction_policy in ("sliding_window", "importance")

    @property
    def version(self) -> str:
        """Short content hash: equal policies have equal versions, so re-applying a config rolls back."""
        fields = asdict(self)
        if self.eviction_policy != "importance":
            del fields["block_budget"]  # unused there: existing pools keep the versions they had
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def describe(self) -> str:
        """One line for the start-up log."""
        pos = list(self.protected_positions)
        span = f"[{pos[0]}..{pos[-1]}]" if pos and pos == list(range(pos[0], pos[-1] + 1)) else str(pos)
        return (
            f"protection set active: positions {span}, roles {list(self.protected_token_roles)}, "
            f"eviction {self.eviction_policy}, window {self.window if self.window is not None else 'derived'}"
            f"{f', block budget {self.block_budget}' if self.eviction_policy == 'importance' else ''}, 16-bit when quantized: "
            f"{'protected blocks + ' if self.keep_protected_16bit else ''}residual {self.residual_window} tokens, "
            f"version {self.version}"
        )


def check_block_budget(budget: int, window: int, block_size: int, field: str) -> None:
    """Raise ``ConfigError`` naming ``field`` unless ``budget`` blocks hold the window plus one more block
    (the window's blocks can never be evicted, so a smaller budget could not be met).

    >>> check_block_budget(6, 64, 16, "block_budget")
    >>> check_block_budget(5, 64, 16, "block_budget")
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: block_budget: must be >= 6 (the window of 64 tokens spans up to 5 blocks, plus one), got 5
    """
    window_blocks = -(-window // block_size) + 1  # an unaligned window straddles one more block
    if budget < window_blocks + 1:
        raise ConfigError(field, f"must be >= {window_blocks + 1} (the window of {window} tokens spans up to "
                                 f"{window_blocks} blocks, plus one), got {budget}")
