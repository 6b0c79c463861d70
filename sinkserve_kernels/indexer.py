"""Lightning-indexer scores over a paged, low-precision indexer-key cache, and the bounded-memory
indexer -> top-k driver used by sparse attention.

For query token ``t`` and cached logical position ``p``::

    score[t, p] = sum_h  w[t, h] * relu(q[t, h, :] . k[p, :])        h over a few indexer heads (Hi ~ 4..64)

``k`` is one small key per cached token (``Di`` ~ 64..128) kept in its own paged cache
``idx_k_cache [num_blocks, block_size, Di]`` addressed by the *same* block tables as the main KV, in bf16 /
fp16 / fp32 or int8 with one fp32 scale per token (``idx_k_scale [num_blocks, block_size]``). Invisible
positions (after the query, past the sequence, in a null block) score ``-inf``.

Memory. Scores are ``T x N`` fp32; a 128K-token prefill would need 64 GiB for them. ``indexer_topk``
therefore processes query rows in chunks whose score buffer fits ``memory_budget_bytes`` and reduces each
chunk to its ``[rows, k]`` slot indices before moving on; the per-head logits ``[T, Hi, N]`` never exist
anywhere (heads are reduced in registers).
"""

from __future__ import annotations

import logging

import torch

from sinkserve_kernels._triton import PER_STEP_INTS, check_device, dot_precision, find_token_seq, interpreting, mma, next_pow2, tl, triton
from sinkserve_kernels.topk import launch_topk

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET = 256 * 1024 * 1024


@triton.jit(do_not_specialize=PER_STEP_INTS["indexer"])
def _indexer_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    ks_ptr,
    out_ptr,
    block_tables_ptr,
    stride_bt,
    seq_lens_ptr,
    qsl_ptr,
    num_seqs,
    token_offset,
    num_cols,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_out,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    IDX_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program = one query token x one tile of ``BLOCK_N`` logical positions."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    tok = token_offset + row
    seq = find_token_seq(qsl_ptr, num_seqs, tok)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - q_len + (tok - q_start)

    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = pos < num_cols
    visible = in_cols & (pos <= q_pos) & (pos < seq_len)
    blk = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=visible, other=0)
    visible = visible & (blk != 0)
    slots = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE

    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    hm = h < NUM_HEADS
    dm = d < IDX_DIM
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + h, mask=hm, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + slots[:, None] * IDX_DIM + d[None, :], mask=visible[:, None] & dm[None, :], other=0)
    if HAS_SCALE:
        # int8 keys: dequantize with the per-token scale, then dot in fp32.
        ks = tl.load(ks_ptr + slots, mask=visible, other=0.0).to(tl.float32)
        kf = k.to(tl.float32) * ks[:, None]
        logits = mma(q, tl.trans(kf), tl.float32, DOT_PREC, INTERP)
    else:
        logits = mma(q, tl.trans(k), q.dtype, DOT_PREC, INTERP)
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)  # [BLOCK_N]: heads reduced in registers
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * stride_out + pos, score, mask=in_cols)


def launch_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    token_offset: int = 0,
    idx_k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write scores of query tokens ``token_offset .. token_offset + out.shape[0] - 1`` into ``out [rows, N]``."""
    rows, num_cols = out.shape
    if rows == 0:
        return out
    _, block_size, di = idx_k_cache.shape
    hi = q.shape[1]
    if not idx_k_cache.is_contiguous():
        raise ValueError("idx_k_cache must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    # fp32 dot when keys are int8 (dequantized to fp32) or queries are fp32; tensor cores for 16-bit.
    prec = dot_precision(torch.float32 if idx_k_scale is not None else q.dtype)
    block_n = 64
    grid = (rows, triton.cdiv(num_cols, block_n))
    _indexer_kernel[grid](
        q, weights, idx_k_cache, idx_k_scale if idx_k_scale is not None else idx_k_cache, out,
        block_tables, block_tables.stride(0), seq_lens, query_start_loc, int(seq_lens.shape[0]),
        token_offset, num_cols, q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
        NUM_HEADS=hi, H_PAD=max(16, next_pow2(hi)), IDX_DIM=di, D_PAD=max(16, next_pow2(di)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, HAS_SCALE=idx_k_scale is not None, DOT_PREC=prec,
        INTERP=interpreting(),
    )  # fmt: skip
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx_k_scale: torch.Tensor | None = None,
    num_cols: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores ``[T, N]`` fp32 for every packed query token; same semantics as ``torch_kernels.indexer_scores``.

    Materializes all ``T x N`` scores: use ``indexer_topk`` for long prefills. ``out`` (optional ``[T, N]``
    fp32) receives the result.
    """
    check_device(q, idx_k_cache, block_tables)
    n = num_cols if num_cols is not None else int(block_tables.shape[1]) * int(idx_k_cache.shape[1])
    _check_cols(n, block_tables, int(idx_k_cache.shape[1]))
    if out is None:
        out = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
    return launch_indexer(q, weights, idx_k_cache, block_tables, seq_lens, query_start_loc, out, 0, idx_k_scale)


def _check_cols(num_cols: int, block_tables: torch.Tensor, block_size: int) -> None:
    # Kernels index the block table with position // block_size: columns past the table would read
    # out of bounds.
    if num_cols > int(block_tables.shape[1]) * block_size:
        raise ValueError(f"num_cols {num_cols} exceeds block table width x block size")


def rows_per_chunk(num_cols: int, memory_budget_bytes: int) -> int:
    """Query rows whose fp32 score rows fit the budget (at least one)."""
    return max(1, memory_budget_bytes // (4 * max(1, num_cols)))


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    k: int,
    window: int = 0,
    forced_mask: torch.Tensor | None = None,
    idx_k_scale: torch.Tensor | None = None,
    num_cols: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer scores then top-k per query token, in row chunks so scores never exceed the memory budget.

    Returns ``[T, k]`` int32 physical slots (``block_id * block_size + offset``), ascending by position,
    -1 padded; the forced set (``window`` most recent positions, ``forced_mask [S, N]``) is always included.
    """
    check_device(q, idx_k_cache, block_tables)
    block_size = int(idx_k_cache.shape[1])
    n = num_cols if num_cols is not None else int(block_tables.shape[1]) * block_size
    _check_cols(n, block_tables, block_size)
    num_tokens = int(q.shape[0])
    if out is None:
        out = torch.empty(num_tokens, k, dtype=torch.int32, device=q.device)
    chunk = min(num_tokens, rows_per_chunk(n, memory_budget_bytes))
    if num_tokens == 0:
        return out
    buf = torch.empty(chunk, n, dtype=torch.float32, device=q.device)  # reused by every chunk
    for r0 in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - r0)
        scores = buf[:rows]
        launch_indexer(q, weights, idx_k_cache, block_tables, seq_lens, query_start_loc, scores, r0, idx_k_scale)
        launch_topk(
            scores, out[r0 : r0 + rows], k, block_tables, seq_lens, query_start_loc, block_size, window, forced_mask, r0
        )
    return out
