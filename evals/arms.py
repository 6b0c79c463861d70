"""The retention policies the long-context evals compare ("arms"), and how an eval builds its engine.

Arms (``window`` and the prefill ``chunk`` are eval settings)::

    dense                no eviction; only inputs that fit the trained context
    window_only          sliding window, nothing protected              (protection "without")
    sinks_window         sliding window + sink positions 0..3 pinned
    sinks_window_anchor  sinks_window + the fact sentence as an anchor  (protection "with", needle)
    importance_<B>       score-driven eviction: sinks pinned, a local window, at most ``block_budget``
                         blocks, the least-attended go first (evals.eviction)

Retention is block granular: a pinned sink position keeps its whole block (``block_size`` tokens), and a
prefill chunk of ``chunk`` tokens runs before the next eviction, so each token sees between ``window``
and ``window + chunk + block_size`` recent tokens (plus the protected blocks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import CachePolicy, EngineConfig, LLMEngine
from engine.config import DEFAULT_MODEL
from engine.worker.sparse_config import SparseAttention
from sinkserve_kernels import block_sparse as bs

logger = logging.getLogger(__name__)

SINK_POSITIONS = (0, 1, 2, 3)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Arm:
    """One policy under test."""

    name: str
    label: str
    sinks: bool
    anchor: bool
    evicts: bool = True
    # KV storage (evals.kv_quant): "auto" = the model dtype; a packed dtype keeps the high-precision set
    # (protected blocks + a 128-token residual window) 16-bit when ``kv_protect``, else packs everything.
    kv_cache_dtype: str = "auto"
    kv_protect: bool = True
    # Sparse attention (evals.sparse): the engine's settings, and which selector ranks the blocks:
    # "block_bounds" / "trained" (the engine's own) or "random" (the control: same budget, same forced set).
    sparse: SparseAttention | None = None
    selector: str = "block_bounds"
    # Retention: "sliding_window" or "importance" (then ``block_budget`` blocks per sequence); ``window``
    # overrides the eval's window for this arm (a fixed-memory comparison sizes each arm's own window).
    eviction: str = "sliding_window"
    block_budget: int = 0
    window: int | None = None
    # Key channels per layer and KV head kept 16-bit beside the codes (0: none) and the value group size
    # (None: the engine's default), for ``--kv-outlier-channels`` / ``--kv-value-group-size``.
    # (None: the engine's defaults). ``block_size`` None: BLOCK_SIZE; the KV A/B runs all its arms at the
    # packed default (64) so that only the storage differs between them, not the eviction granularity.
    kv_outlier_channels: int | None = None
    kv_value_group_size: int | None = None
    block_size: int | None = None

    def kv_storage(self) -> dict[str, object]:
        """The arm's KV-storage settings as ``make_engine`` keyword arguments."""
        return dict(kv_cache_dtype=self.kv_cache_dtype, kv_outlier_channels=self.kv_outlier_channels,
                    kv_value_group_size=self.kv_value_group_size, block_size=self.block_size or BLOCK_SIZE)

    def policy(self, window: int) -> CachePolicy:
        # int2 refuses an empty high-precision set (ConfigError): its "everything" ablation keeps a 1-token
        # residual, which is the block being written anyway.
        residual = 128 if self.kv_protect else (1 if self.kv_cache_dtype == "int2" else 0)
        hp = dict(residual_window=residual, keep_protected_16bit=self.kv_protect)
        if not self.evicts:
            return CachePolicy(eviction_policy="none", **hp)
        extra = dict(block_budget=self.block_budget) if self.eviction == "importance" else {}
        return CachePolicy(
            eviction_policy=self.eviction,  # type: ignore[arg-type]
            window=self.window or window,
            **extra,
            protected_positions=SINK_POSITIONS if self.sinks else (),
            protected_token_roles=("sink",),
            max_stream_tokens=1 << 22,
            **hp,
        )


DENSE = Arm("dense", "dense (trained context)", sinks=False, anchor=False, evicts=False)
WINDOW_ONLY = Arm("window_only", "window only", sinks=False, anchor=False)
SINKS_WINDOW = Arm("sinks_window", "sinks + window", sinks=True, anchor=False)
SINKS_WINDOW_ANCHOR = Arm("sinks_window_anchor", "sinks + window + anchor", sinks=True, anchor=True)


def setup_torch(threads: int) -> None:
    """Pin torch to ``threads`` intra-op threads.

    Why: on this shared 2-core machine the default (one thread per core) thrashes against the other
    jobs; a 2K-token stream took 40 s with 2 threads and 3 s with 1 (measured).
    """
    torch.set_num_threads(max(1, threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def default_model() -> str:
    return DEFAULT_MODEL


def trained_context(model: str | Path) -> int:
    """The context the model was trained on (``engine.limits.trained_context`` of its config.json)."""
    from engine.worker.architectures import read_model_shape

    return read_model_shape(str(model)).trained_context


def model_fingerprint(model: str | Path) -> str:
    """First 16 hex digits of the sha256 of the weights and ``config.json``, so a result names the exact
    model it measured (the config counts: the same weights with another RoPE base are another model)."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(Path(model).glob("*.safetensors")) or sorted(Path(model).glob("*.bin"))
    config = Path(model) / "config.json"
    for f in files + ([config] if files and config.exists() else []):
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16] if files else "unknown"


def make_engine(model: str | Path, policy: CachePolicy, chunk: int, num_kv_blocks: int, max_num_seqs: int = 64,
                kv_cache_dtype: str = "auto", kv_outlier_channels: int | None = None,
                kv_value_group_size: int | None = None, block_size: int = BLOCK_SIZE,
                sparse: SparseAttention | None = None, selector: str = "block_bounds") -> LLMEngine:
    """An engine for one arm.

    Prefix caching is off so every request is computed from its own tokens under the arm's policy; the
    attention backend is the default (the torch reference on CPU gathers kept blocks only, so a long stream
    costs its window, not its history).
    """
    backend = "auto"
    config = EngineConfig(
        model=str(model),
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=chunk,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        attention_backend=backend,
        cache_policy=policy,
        kv_cache_dtype=kv_cache_dtype,
        kv_outlier_channels=kv_outlier_channels,
        kv_value_group_size=kv_value_group_size,
        sparse=sparse or SparseAttention(),
    )
    engine = LLMEngine(config)
    if selector == "random":  # block_bounds and trained are the engine's own (sparse.indexer)
        use_selector(engine, selector)
    return engine


def use_selector(engine: Any, selector: str, seed: int = 0) -> None:
    """Swap the engine's block ranking for a control (``random``): same forced set, same budget. The
    backend instance of this engine's runner is replaced; nothing global changes."""
    if selector != "random":
        raise ValueError(f"unknown selector {selector!r}")
    gen = torch.Generator().manual_seed(seed)

    def random_scores(q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.rand(q.shape[0], 1, bounds.shape[1], generator=gen).expand(-1, q.shape[1], -1).to(q.device)

    runner = engine.executor.runner
    runner.backend = dataclasses.replace(runner.backend, block_sparse_attention=functools.partial(
        bs.block_sparse_attention, attend=bs.attend_gather, score=random_scores))
    # The C decode step selects with its own (block_bounds) scores: the control's decode steps run the eager
    # forward, which calls the backend swapped in above (counted as eager in decode_steps).
    if hasattr(runner.model, "c_step"):
        runner.model.c_step = False


def blocks_for_stream(window: int, chunk: int, protected_blocks: int = 2) -> int:
    """KV blocks one streaming sequence can hold at once: window + chunk + partial blocks + protected ones."""
    return -(-(window + chunk) // BLOCK_SIZE) + 2 + protected_blocks
