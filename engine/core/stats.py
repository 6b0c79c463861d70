"""Engine statistics: typed counters the engine mutates, and the frozen snapshot ``stats()`` returns.

The snapshot is what metrics, the engine process and tests read; ``as_dict()`` gives the plain
mapping the Prometheus collector walks (``app/metrics.py`` names the metric for each field).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

# Upper bounds of the ``sparse_attended_tokens`` histogram (tokens a sequence's last query attends in a step).
SPARSE_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass
class EngineCounters:
    """Monotonic counters, mutated by the engine while it steps (under its lock)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    tokens_protected_total: int = 0
    requests_finished_total: int = 0
    nll_sum: float = 0.0  # negative log-likelihood of sampled tokens: the perplexity proxy
    nll_count: int = 0
    steps_total: int = 0
    # Sparse attention (only counted when EngineConfig.sparse is enabled): per scheduled sequence and step,
    # the tokens its last query attends and the tokens it could see (engine/worker/sparse.py).
    sparse_attended_counts: list[int] = field(default_factory=lambda: [0] * (len(SPARSE_TOKEN_BUCKETS) + 1))
    sparse_attended_tokens_total: int = 0
    sparse_context_tokens_total: int = 0
    sparse_sequence_steps_total: int = 0  # sequence-steps that attended sparsely
    sparse_step_attended: int = 0  # the current step's sums (the fraction gauge)
    sparse_step_context: int = 0
    sparse_step: int = -1
    # Decode steps by the path that ran them (engine/worker/decode_path.py: c_step, eager, triton).
    decode_steps: dict[str, int] = field(default_factory=dict)

    def observe_sparse(self, attended: int, visible: int, is_sparse: bool) -> None:
        """One scheduled sequence of the current step (``steps_total`` identifies the step)."""
        self.sparse_attended_counts[bisect.bisect_left(SPARSE_TOKEN_BUCKETS, attended)] += 1
        self.sparse_attended_tokens_total += attended
        self.sparse_context_tokens_total += visible
        self.sparse_sequence_steps_total += int(is_sparse)
        if self.sparse_step != self.steps_total:
            self.sparse_step, self.sparse_step_attended, self.sparse_step_context = self.steps_total, 0, 0
        self.sparse_step_attended += attended
        self.sparse_step_context += visible


@dataclass(frozen=True)
class EngineStats:
    """One consistent snapshot of the engine: gauges (queue, blocks) and counters."""

    running: int = 0
    waiting: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    blocks_pinned: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    tokens_evicted: int = 0
    evictions_deferred: int = 0
    tokens_protected: int = 0
    preemptions: int = 0
    policy_version: str = ""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    nll_sum: float = 0.0
    nll_count: int = 0
    steps_total: int = 0
    # KV storage: allocated KV bytes (packed pool + 16-bit side pool, all ranks) per token slot; blocks in
    # use by precision (a quantized cache; otherwise every used block counts as 16-bit).
    kv_cache_bytes_per_token: float = 0.0
    blocks_16bit: int = 0
    blocks_quantized: int = 0
    blocks_protected_quantized: int = 0  # protected blocks packed because the side pool ran low
    # Sparse attention: histogram of attended tokens per sequence-step (counts per SPARSE_TOKEN_BUCKETS
    # bound, last = above), its sum, the context those queries could see, and the last step's fraction.
    sparse_attended_tokens_buckets: tuple[int, ...] = ()
    sparse_attended_tokens_total: int = 0
    sparse_context_tokens_total: int = 0
    sparse_sequence_steps_total: int = 0
    sparse_attended_fraction: float = 1.0
    # Per layer type (engine/worker/architectures.py): full-attention layers read every used block; the model's
    # sliding-window layers only the blocks inside their window (the rest they have left behind, kept
    # for the full layers). Equal to blocks_used when the model has no sliding layer.
    sliding_layers: int = 0
    blocks_needed_sliding: int = 0
    # The pool's decode step (engine/worker/decode_path.py), decided once at start-up, and the decode steps each
    # path actually ran ((path, steps) pairs: a C-step pool's oversized batch runs eagerly).
    decode_path: str = ""
    decode_steps: tuple[tuple[str, int], ...] = ()
    # Session KV (engine/memory/session_cache.py; zeros when it is off): the store directory as this engine last saw
    # it (bytes, entries), its reads that found / missed an entry, entries it evicted, bytes it wrote; turns
    # that restored KV and the tokens they restored, turns saved, blocks a save found already stored (shared),
    # and (reason, turns) that carried a session but re-prefilled.
    session_kv_store_bytes: int = 0
    session_kv_store_entries: int = 0
    session_kv_store_hits: int = 0
    session_kv_store_misses: int = 0
    session_kv_store_evictions: int = 0
    session_kv_store_bytes_written: int = 0
    session_kv_restores: int = 0
    session_kv_restored_tokens: int = 0
    session_kv_saves: int = 0
    session_kv_shared_blocks: int = 0
    session_kv_fallbacks: tuple[tuple[str, int], ...] = ()
    session_kv_save_failures: tuple[tuple[str, int], ...] = ()  # reason -> finished turns whose KV was not saved
    # The engine front's writes on the token bus (engine/frontend/token_bus.py): frames, and the deltas in them.
    token_bus_frames: int = 0
    token_bus_deltas: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
