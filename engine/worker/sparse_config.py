"""Sparse-attention settings (``EngineConfig.sparse``): which positions a long sequence's queries attend.

Two stages per query: an indexer scores every cached block, the top ``top_k`` tokens' worth of blocks is
selected, and the *forced set* is always added on top (it never counts against ``top_k``)::

    logical blocks:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ][ 6 ][ 7 ][ 8 ][ 9 ]     block_size 16, query at 150
    forced:           sink           anchor                   [ window  ]   protected blocks + local_window 16
    top_k 32:                   [2]            [5]                          2 best-scoring other blocks
    attended:         0, 2, 3, 5, 8, 9   (5 full blocks + 7 tokens of block 9: 87 of 151 tokens)

The forced set is the sequence's protection set (``CachePolicy`` positions and roles, per-request
anchors: the blocks retention pins) plus the blocks holding the newest ``local_window`` tokens before
the query. Sequences shorter than ``min_context`` attend densely. Pure Python: no torch.

``position_mode: compact`` is selected memory past the trained context (``engine/worker/selected_memory.py``):
the cache keeps every block, a sequence may grow to ``max_model_len`` (else the policy's
``max_stream_tokens``) beyond the model's trained context, and the attended blocks are seen at consecutive
positions, so the attended span (``selected_span``) must fit the trained context.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.errors import ConfigError
from sinkserve_kernels.sparse_geometry import PREFILL_GROUP

INDEXERS = ("block_bounds", "trained")
# "absolute": keys are seen at the positions they were stored at (sequences stay inside max_model_len);
# "compact": selected memory, the attended blocks are re-positioned to be consecutive (engine/worker/selected_memory.py).
POSITION_MODES = ("absolute", "compact")
# Trained lightning-indexer weights ship beside the model's weights under this name.
INDEXER_WEIGHTS = "indexer.safetensors"
# PREFILL_GROUP (block_bounds' prefill queries sharing one selection, 128) is defined with the kernels that
# use it, in sinkserve_kernels/sparse_geometry.py (pure Python).
# Selected memory (position_mode compact) keeps groups of 64: a group's own tokens are part of the attended
# span that must fit the trained context (``selected_span``), and that mode's budgets were sized for 64.
COMPACT_PREFILL_GROUP = 64


@dataclass(frozen=True)
class SparseAttention:
    """Sparse attention for long sequences (off by default).

    ``top_k``: tokens selected by the indexer per query, beyond the forced set; selection is block
    granular (``top_k // block_size`` blocks). ``min_context``: a sequence attends sparsely once its
    context (cached + new tokens) reaches this many tokens. ``indexer``: ``block_bounds`` (per-block
    per-channel key min/max, Quest's upper bound; training-free, any model) or ``trained`` (a lightning
    indexer shipped as ``indexer.safetensors`` in the model directory). ``decode`` / ``prefill``: which
    steps select (a prefill chunk's queries select in groups of ``prefill_group`` tokens that share one
    selection; the trained indexer selects per query).
    ``position_mode``: ``absolute`` (keys seen where they were stored) or ``compact`` (selected memory past
    the trained context: the attended blocks are seen consecutively; see ``engine/worker/selected_memory.py``).
    """

    enabled: bool = False
    indexer: str = "block_bounds"
    # None: derived from the model's trained context ctx (engine/limits.py): top_k ctx/8, min_context ctx
    # (dense inside the trained context), local_window ctx/16.
    top_k: int | None = None
    min_context: int | None = None
    local_window: int | None = None
    decode: bool = True
    prefill: bool = True
    position_mode: str = "absolute"

    def validate(self, block_size: int, model_dir: str | None = None) -> None:
        """Raise ``ConfigError`` naming the field (``sparse.<name>``) if these settings cannot work. Bounds
        that depend on the model's context (``top_k``, ``local_window``) are ``engine.limits.derive_limits``'."""
        if self.indexer not in INDEXERS:
            raise ConfigError("sparse.indexer", f"unknown indexer {self.indexer!r}; choose one of {list(INDEXERS)}")
        if self.top_k is not None and self.top_k < block_size:
            raise ConfigError("sparse.top_k", f"must be at least one block ({block_size} tokens), got {self.top_k}")
        if self.min_context is not None and self.min_context < 1:
            raise ConfigError("sparse.min_context", f"must be >= 1, got {self.min_context}")
        if self.local_window is not None and self.local_window < 1:
            raise ConfigError("sparse.local_window", f"must be >= 1 (the query's own block), got {self.local_window}")
        if self.enabled and not (self.decode or self.prefill):
            raise ConfigError("sparse.decode", "sparse attention is enabled but neither decode nor prefill selects")
        if self.position_mode not in POSITION_MODES:
            raise ConfigError("sparse.position_mode", f"unknown mode {self.position_mode!r}; choose one of {list(POSITION_MODES)}")
        if self.position_mode == "compact" and not self.enabled:
            raise ConfigError("sparse.position_mode", "'compact' (selected memory) needs sparse.enabled: true")
        if self.compact and self.indexer != "block_bounds":
            # The trained indexer's Wq / Wk mix the rotary channels of post-RoPE q and k, so its score depends
            # on absolute positions, and past the trained context those are rotary angles it never trained on.
            # It would need position-free index keys (pre-RoPE k, queries at a canonical distance, trained that
            # way) and block-granular selection for the shift rule (engine/worker/selected_memory.py).
            raise ConfigError("sparse.indexer", "position_mode 'compact' selects with 'block_bounds' (position-free "
                              f"bounds); {self.indexer!r} scores post-RoPE queries and keys at their absolute "
                              "positions, which past the trained context it never saw (docs/evals/smollm2/indexer.md)")
        if self.compact and not (self.decode and self.prefill):
            # A dense step past the trained context would see keys at distances the model never trained on.
            raise ConfigError("sparse.prefill" if not self.prefill else "sparse.decode",
                              "position_mode 'compact' needs both decode and prefill to select")
        if self.enabled and self.indexer == "trained" and model_dir is not None:
            path = Path(model_dir) / INDEXER_WEIGHTS
            if not path.is_file():
                raise ConfigError("sparse.indexer", f"'trained' needs indexer weights at {path} (none found); "
                                  "use 'block_bounds' for a model without a trained indexer")

    @property
    def compact(self) -> bool:
        """Whether this is selected memory past the trained context (``position_mode: compact``)."""
        return self.enabled and self.position_mode == "compact"

    @property
    def prefill_group(self) -> int:
        """Consecutive prefill queries that share one block selection (``PREFILL_GROUP``; selected memory:
        ``COMPACT_PREFILL_GROUP``)."""
        return COMPACT_PREFILL_GROUP if self.compact else PREFILL_GROUP

    def selected_span(self, block_size: int, protected_positions: tuple[int, ...]) -> int:
        """The most tokens one query (group) attends in compact mode, hence the longest distance it sees:
        the blocks of the protected positions, ``top_k``, and the window of a prefill group (``local_window +
        prefill_group - 1`` tokens, one more block when unaligned), in whole blocks. Per-request anchors
        come on top.

        >>> SparseAttention(enabled=True, top_k=128, local_window=64, position_mode="compact").selected_span(16, (0, 1, 2, 3))
        288
        """
        window_blocks = -(-(self.local_window + self.prefill_group - 1) // block_size) + 1
        protected = len({p // block_size for p in protected_positions})
        return (protected + self.top_blocks(block_size) + window_blocks) * block_size

    def validate_compact(self, block_size: int, protected_positions: tuple[int, ...], trained_context: int) -> None:
        """Compact mode: the attended span and the dense steps must stay inside the model's trained context
        (``max_position_embeddings``); ``ConfigError`` naming the field otherwise."""
        if not self.compact:
            return
        span = self.selected_span(block_size, protected_positions)
        if span > trained_context:
            raise ConfigError("sparse.top_k", f"position_mode 'compact' attends up to {span} tokens per query "
                              f"(protected blocks + top_k {self.top_k} + local_window {self.local_window} + a prefill "
                              f"group, block granular), more than the model's trained context ({trained_context}); "
                              "lower top_k or local_window")
        if self.min_context > trained_context:
            raise ConfigError("sparse.min_context", f"position_mode 'compact' needs min_context <= the trained "
                              f"context ({trained_context}): a dense step past it would see untrained distances; "
                              f"got {self.min_context}")

    def top_blocks(self, block_size: int) -> int:
        """Blocks the indexer selects per query (block granular ``top_k``)."""
        return self.top_k // block_size

    def describe(self) -> str:
        """One line for the start-up log (beside the protection set)."""
        if not self.enabled:
            return "sparse attention off"
        steps = [s for s, on in (("decode", self.decode), ("prefill", self.prefill)) if on]
        mode = (", selected memory: attended blocks re-positioned to be consecutive (position_mode compact), "
                "full cache, streams past the trained context" if self.compact else "")
        return (f"sparse attention on: indexer {self.indexer}, top_k {self.top_k} tokens + forced set "
                f"(protection set, anchors, local window {self.local_window}) from {self.min_context} tokens of "
                f"context, steps {steps}{mode}")


def policy_version(policy_version: str, sparse: SparseAttention) -> str:
    """The version metrics and logs report: the cache policy's own content hash while sparse attention is
    off (unchanged versions for existing pools), else a hash of both, so turning sparsity on or changing
    its budget is a new version.

    >>> policy_version("abc", SparseAttention())
    'abc'
    >>> policy_version("abc", SparseAttention(enabled=True)) != policy_version("abc", SparseAttention(enabled=True, top_k=1024))
    True
    """
    if not sparse.enabled:
        return policy_version
    fields = asdict(sparse)
    if sparse.position_mode == "absolute":
        del fields["position_mode"]  # the default: existing sparse pools keep the versions they had
    blob = json.dumps({"policy": policy_version, "sparse": fields}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
