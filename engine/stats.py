"""Engine statistics: typed counters the engine mutates, and the frozen snapshot ``stats()`` returns.

The snapshot is what metrics, the engine process and tests read; ``as_dict()`` gives the plain
mapping the Prometheus collector walks (``app/metrics.py`` names the metric for each field).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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
    # Per layer type (engine/architectures.py): full-attention layers read every used block; the model's
    # sliding-window layers only the blocks inside their window (the rest they have left behind, kept
    # for the full layers). Equal to blocks_used when the model has no sliding layer.
    sliding_layers: int = 0
    blocks_needed_sliding: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
