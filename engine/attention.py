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
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.architectures import AttentionLayout, check_hook_window
from engine.attention_backends import AttentionBackend

ATTN_IMPLEMENTATION = "sinkserve_paged"


@dataclass
class ForwardContext:
    """What one forward pass of a ragged batch needs in every attention layer."""

    backend: AttentionBackend
    kv_caches: list  # per layer (k_cache, v_cache), or a kernels.kv_quant.QuantKVCache when quantized
    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] logical tokens in cache after this forward
    query_start_loc: torch.Tensor  # [S + 1]
    quantized: bool = False
    # Outlier calibration: per layer, the running max |key| per (KV head, channel); None when not calibrating.
    key_absmax: list[torch.Tensor | None] | None = None
    # Per-layer attention (window, sinks) of the model; None: every layer full (kernel tests, tools).
    layout: AttentionLayout | None = None


_CONTEXT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("sinkserve_forward", default=None)


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

    Per layer, ``sliding_window`` (checked against the engine's layout, ``engine/architectures.py``) limits
    what each query sees, and ``s_aux`` (gpt-oss) carries the learned sink logits ``[Hq]``.
    """
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError("sinkserve attention called outside a forward_context (use the engine's model runner)")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported by the sinkserve attention backends")
    window = None
    if ctx.layout is not None:
        window = check_hook_window(ctx.layout, module.layer_idx, kwargs.get("sliding_window")).window  # type: ignore[arg-type]
    sinks = kwargs.get("s_aux")
    q = query[0].transpose(0, 1)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if ctx.key_absmax is not None:
        m = k.detach().abs().amax(0).float()  # [Hkv, D]
        prev = ctx.key_absmax[module.layer_idx]
        ctx.key_absmax[module.layer_idx] = m if prev is None else torch.maximum(prev, m)
    if ctx.quantized:
        cache = ctx.kv_caches[module.layer_idx]
        ctx.backend.write_kv_quant(k, v, cache, ctx.slot_mapping)
        out = ctx.backend.paged_attention_quant(q, cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, scale,
                                                window=window, sinks=sinks)
        return out.unsqueeze(0), None
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = ctx.backend.paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, scale,
                                      window=window, sinks=sinks)
    return out.unsqueeze(0), None


def _no_mask(*args: object, **kwargs: object) -> None:
    # Causality and sequence boundaries come from the paged metadata, not from a dense mask.
    return None


def register() -> None:
    """Make ``attn_implementation=ATTN_IMPLEMENTATION`` available to transformers models (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
