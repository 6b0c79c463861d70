"""A CPU attention backend for long streams: the torch reference math over the *kept* blocks only.

``kernels.reference.paged_attention`` gathers every logical position of a sequence, null blocks
included, and masks the evicted ones. That is the obvious ground truth, but for a stream of ``n``
tokens it costs ``O(n)`` per step even though only ``protected + window`` tokens are kept, so a 16K-token
eval is quadratic (measured: 8K tokens take ~13x as long as 2K). The Triton kernel skips null blocks;
this backend does the same in torch so the long evals run in linear time on the CPU.

Same inputs, same outputs (up to float summation order) as the reference: keys stay at their logical
positions, so the causal mask and everything the engine computes (rotations, eviction, block tables) is
unchanged. ``tests/test_evals.py`` checks it against the reference on tables with null blocks.
"""

from __future__ import annotations

import torch

from engine.attention_backends import AttentionBackend, available_backends, register_backend
from kernels import reference

BACKEND_NAME = "torch_compact"


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, Hq, D]`` over the non-null blocks of each sequence."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    offsets = torch.arange(block_size, device=query.device)
    for i, seq_len in enumerate(lens):
        n = starts[i + 1] - starts[i]
        if n == 0:
            continue
        row = block_tables[i, : -(-seq_len // block_size)].long()
        logical = torch.nonzero(row != reference.NULL_BLOCK).flatten()
        blocks = row[logical]
        keys = k_cache[blocks].flatten(0, 1).transpose(0, 1)  # [Hkv, K, D]
        values = v_cache[blocks].flatten(0, 1).transpose(0, 1)
        k_pos = (logical[:, None] * block_size + offsets[None, :]).flatten()
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # causal; also drops slots past seq_len
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)  # [Hq, n, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[None].to(q.dtype), values[None].to(q.dtype), attn_mask=mask[None, None],
            scale=scale, enable_gqa=keys.shape[0] != q.shape[0],
        )
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out


def compact_backend() -> AttentionBackend:
    return AttentionBackend(BACKEND_NAME, reference.write_kv, paged_attention)


def register() -> str:
    """Make ``attention_backend="torch_compact"`` available to ``EngineConfig`` (idempotent)."""
    if BACKEND_NAME not in available_backends():
        register_backend(BACKEND_NAME, f"{__name__}:compact_backend")
    return BACKEND_NAME
