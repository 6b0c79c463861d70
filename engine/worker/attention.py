"""The attention function registered with transformers, and the per-forward context it reads.

Every attention layer of a loaded model calls ``paged_attention_forward`` instead of transformers' own
SDPA: it writes the layer's new keys/values into the engine's paged cache and attends over it with the
configured backend. Per-forward metadata (slots, block tables, lengths) lives in a scoped context set by
the model runner, not in layer signatures.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.worker import importance
from engine.worker.architectures import AttentionLayout, check_hook_window
from engine.worker.kv_cache import KVCache
from sinkserve_kernels.backend import AttentionBackend
from sinkserve_kernels import block_sparse as _sparse

ATTN_IMPLEMENTATION = "sinkserve_paged"


@dataclass
class ForwardContext:
    """What one forward pass of a ragged batch needs in every attention layer."""

    backend: AttentionBackend
    kv_cache: KVCache  # every layer's K/V (dense or packed), written and read through it
    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] logical tokens in cache after this forward
    query_start_loc: torch.Tensor  # [S + 1]
    # Outlier calibration: per layer, the running max |key| per (KV head, channel); None when not calibrating.
    key_absmax: list[torch.Tensor | None] | None = None
    # Sparse attention (engine/worker/sparse_config.py): per layer block key bounds, kept current on every write
    # when sparsity is configured; the step's selection rules when some sequence attends sparsely now.
    block_bounds: list | None = None  # per layer sinkserve_kernels.block_sparse.BlockBounds
    sparse_plan: object | None = None  # sinkserve_kernels.block_sparse.SparsePlan
    # The trained lightning indexer (sparse.indexer 'trained'): weights + per-layer index-key caches
    # (engine.worker.indexer_runtime.IndexerState), written beside K/V; selection then ranks tokens by it.
    indexer: object | None = None
    # Selected memory (sparse.position_mode compact, engine/worker/selected_memory.py): bounds of pre-RoPE keys and
    # attention over re-positioned selections; None in every other mode.
    selected_memory: object | None = None  # engine.worker.selected_memory.StepContext
    # Per-layer attention (window, sinks) of the model; None: every layer full (kernel tests, tools).
    layout: AttentionLayout | None = None
    # ``importance`` eviction: per layer, scheduled sequence and logical block ``[L, S, W]``, the largest
    # attention mass a query head's observation queries put there (engine/worker/importance.py); None when the
    # policy does not score.
    block_importance: torch.Tensor | None = None
    # The backend's per-step plans (``AttentionBackend.plan``) by sliding window, each built by the first
    # layer that needs it and shared by the others (the metadata is the same in every layer).
    plans: dict = field(default_factory=dict)

    def plan_kwargs(self, window: int | None, block_size: int) -> dict:
        """``{"plan": ...}`` for the backend call of a layer with ``window``, or ``{}`` (backend takes none)."""
        if self.backend.plan is None:
            return {}
        if window not in self.plans:
            self.plans[window] = self.backend.plan(self.block_tables, self.seq_lens, self.query_start_loc, block_size,
                                                   window)
        return {"plan": self.plans[window]}


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("sinkserve_forward", default=None)


def current_context() -> ForwardContext | None:
    """The forward context the model runner set for this step (None outside a step)."""
    return _CONTEXT.get()


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query [1, Hq, T, D]``, ``key/value [1, Hkv, T, D]`` -> ``[1, T, Hq, D]``.

    Per layer, ``sliding_window`` (checked against the engine's layout, ``engine/worker/architectures.py``) limits
    what each query sees, and ``s_aux`` (gpt-oss) carries the learned sink logits ``[Hq]``.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported by the sinkserve attention backends")
    out = attend_tokens(module, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                        scaling if scaling is not None else query.shape[-1] ** -0.5, kwargs.get("sliding_window"),
                        kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def attend_tokens(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention_forward`` on the packed token axis: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` ->
    ``[T, Hq, D]``. The native forward calls this directly (its tensors already have this layout); the
    transformers hook reaches it through ``paged_attention_forward``, so both paths run the same code."""
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("sinkserve attention called outside a forward_context (use the engine's model runner)")
    window = None
    if ctx.layout is not None:
        window = check_hook_window(ctx.layout, module.layer_idx, sliding_window).window  # type: ignore[arg-type]
    if ctx.key_absmax is not None:
        m = k.detach().abs().amax(0).float()  # [Hkv, D]
        prev = ctx.key_absmax[module.layer_idx]
        ctx.key_absmax[module.layer_idx] = m if prev is None else torch.maximum(prev, m)
    cache = ctx.kv_cache
    if ctx.block_bounds is not None:
        kb = k if ctx.selected_memory is None else ctx.selected_memory.bounds_keys(k, module.layer_idx)
        _sparse.update_bounds(ctx.block_bounds[module.layer_idx], kb, ctx.slot_mapping, cache.block_size)
    if ctx.indexer is not None:
        ctx.indexer.write(module.layer_idx, k, ctx.slot_mapping)
    # Sparse selection on full-attention layers without learned sinks: a sliding-window layer is already
    # bounded by its window, and the block-sparse path has no sink logit (such layers stay on the paged path).
    sparse = ctx.sparse_plan is not None and window is None and sinks is None
    layer = module.layer_idx
    plan = ctx.plan_kwargs(window, cache.block_size)
    cache.write(ctx.backend, layer, k, v, ctx.slot_mapping)
    _score(ctx, layer, q, cache.layers[layer], scale, window)
    if sparse:
        return _sparse_forward(ctx, layer, q, cache.layers[layer], scale)
    return cache.paged_attention(ctx.backend, layer, q, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, scale,
                                 window=window, sinks=sinks, **plan)


def _score(ctx: ForwardContext, layer: int, q: torch.Tensor, kv: object, scale: float, window: int | None) -> None:
    # Full-attention layers only: a sliding-window layer never reads the blocks eviction chooses between.
    if ctx.block_importance is not None and window is None:
        importance.accumulate(ctx.block_importance[layer], q, kv, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                              scale, ctx.kv_cache.block_size)


def _sparse_forward(ctx: ForwardContext, layer: int, q: torch.Tensor, kv: object, scale: float) -> torch.Tensor:
    if ctx.indexer is not None:
        assert ctx.backend.indexed_sparse_attention is not None
        iq, iw = ctx.indexer.queries(layer, q)
        return ctx.backend.indexed_sparse_attention(q, kv, iq, iw, ctx.indexer.caches[layer], ctx.block_tables,
                                                    ctx.seq_lens, ctx.query_start_loc, ctx.sparse_plan,
                                                    scale).unsqueeze(0)
    assert ctx.block_bounds is not None and ctx.backend.block_sparse_attention is not None
    if ctx.selected_memory is not None:
        return ctx.selected_memory.attention(layer, q, kv, ctx.block_bounds[layer], ctx.block_tables, ctx.seq_lens,
                                             ctx.query_start_loc, ctx.sparse_plan, scale)
    return ctx.backend.block_sparse_attention(q, kv, ctx.block_bounds[layer], ctx.block_tables, ctx.seq_lens,
                                              ctx.query_start_loc, ctx.sparse_plan, scale)


def _no_mask(*args: object, **kwargs: object) -> None:
    # Causality and sequence boundaries come from the paged metadata, not from a dense mask.
    return None


def register() -> None:
    """Make ``attn_implementation=ATTN_IMPLEMENTATION`` available to transformers models (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
