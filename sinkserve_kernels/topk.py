"""Top-k selection per query row with a forced set, emitting physical cache slots.

For every query token (row of ``scores [T, N]``) the kernel selects, among the *visible* logical positions
(at or before the query, inside the sequence, not in a null block):

* every forced position — the local ``window`` (``pos - window < p <= pos``) and positions marked in
  ``forced_mask [S, N]`` (attention sinks, system prompt, anchors) — then
* the highest-scoring other positions until ``k`` are chosen (ties -> lower position);
* all visible positions when there are at most ``k`` (short rows fall back to dense).

Output: ``[T, k]`` int32 slots ``block_id * block_size + offset`` in ascending position order, -1 padded.

Algorithm: one program per row, exact radix select without sorting. Each score becomes a 33-bit
order-preserving integer key (invisible = 0, forced = 2^32 + 1 above every float), a radix search
over 9 counting passes (4 bits each, all 16 digits counted at once) finds the k-th largest key ``tau``,
and a final in-order pass emits ``key > tau`` plus the first ``k - count(key > tau)`` ties, using prefix
sums for output positions. Memory is O(k) per row whatever N is; rows with <= k visible positions skip
the search.
"""

from __future__ import annotations

import logging

import torch

from sinkserve_kernels._triton import PER_STEP_INTS, check_device, find_token_seq, next_pow2, tl, triton

logger = logging.getLogger(__name__)

FORCED_KEY = (1 << 32) + 1


@triton.jit
def _row_keys(
    scores_row_ptr, pos, hi, q_pos, bt_row_ptr, forced_row_ptr, window, BLOCK_SIZE: tl.constexpr, HAS_FORCED: tl.constexpr
):
    """Order-preserving int64 keys of one tile (0 = invisible, FORCED_KEY = forced) and its slots."""
    inr = pos < hi
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=inr, other=0)
    visible = inr & (blk != 0)
    s = tl.load(scores_row_ptr + pos, mask=visible, other=0.0)
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    mag = bits & 0x7FFFFFFF
    # float order -> integer order: negatives reversed below 2^31, non-negatives from 2^31 up; +1 keeps 0 free.
    key = tl.where(bits >= 0, mag + 0x80000000, 0x7FFFFFFF - mag) + 1
    key = tl.where(s != s, 1, key)  # NaN ranks lowest among visible positions
    forced = pos > q_pos - window
    if HAS_FORCED:
        forced = forced | (tl.load(forced_row_ptr + pos, mask=visible, other=0) != 0)
    key = tl.where(forced, 4294967297, key)
    key = tl.where(visible, key, 0)
    slots = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    return key, slots


@triton.jit(do_not_specialize=PER_STEP_INTS["topk"])
def _topk_kernel(
    scores_ptr,
    out_ptr,
    block_tables_ptr,
    stride_bt,
    seq_lens_ptr,
    qsl_ptr,
    forced_ptr,
    stride_forced,
    num_seqs,
    token_offset,
    num_cols,
    window,
    k,
    stride_s,
    stride_o,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_FORCED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tok = token_offset + row
    seq = find_token_seq(qsl_ptr, num_seqs, tok)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - q_len + (tok - q_start)
    # Only positions <= q_pos and < seq_len can be visible: scan [0, hi).
    hi = tl.minimum(tl.minimum(q_pos + 1, seq_len), num_cols)
    srow = scores_ptr + row * stride_s
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    frow = forced_ptr + seq.to(tl.int64) * stride_forced
    orow = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK_N)

    n_visible = 0
    for start in range(0, hi, BLOCK_N):
        key, _ = _row_keys(srow, start + offs, hi, q_pos, bt_row, frow, window, BLOCK_SIZE, HAS_FORCED)
        n_visible += tl.sum((key > 0).to(tl.int32), 0)

    # tau = largest t with count(key >= t) >= k; with <= k visible positions, tau = 0 selects them all.
    tau = tl.zeros([], dtype=tl.int64)
    if n_visible > k:
        # Radix select, 4 bits per pass (9 passes over the row): count keys >= tau | (d << shift) for all 16
        # digits d at once and keep the largest digit whose count still reaches k.
        digits = tl.arange(0, 16).to(tl.int64)
        for i in range(0, 9):
            shift = 32 - 4 * i
            cand = tau | (digits << shift)
            cnt = tl.zeros([16], dtype=tl.int32)
            for start in range(0, hi, BLOCK_N):
                key, _ = _row_keys(srow, start + offs, hi, q_pos, bt_row, frow, window, BLOCK_SIZE, HAS_FORCED)
                cnt += tl.sum((key[:, None] >= cand[None, :]).to(tl.int32), 0)
            best = tl.sum((cnt >= k).to(tl.int64), 0) - 1  # counts fall as d grows; d = 0 always qualifies
            tau = tau | (best << shift)
    n_above = 0
    for start in range(0, hi, BLOCK_N):
        key, _ = _row_keys(srow, start + offs, hi, q_pos, bt_row, frow, window, BLOCK_SIZE, HAS_FORCED)
        n_above += tl.sum((key > tau).to(tl.int32), 0)
    need_ties = k - n_above

    # Emit in position order; prefix sums give each selected position its output column.
    n_sel = 0
    n_ties = 0
    for start in range(0, hi, BLOCK_N):
        key, slots = _row_keys(srow, start + offs, hi, q_pos, bt_row, frow, window, BLOCK_SIZE, HAS_FORCED)
        # (`!= 0`: the interpreter can widen bool & bool-scalar results to integers)
        tie = ((key == tau) & (tau > 0)) != 0
        tie_rank = n_ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        sel = ((key > tau) | (tie & (tie_rank < need_ties))) != 0
        col = n_sel + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(orow + col, slots.to(tl.int32), mask=sel)
        n_sel += tl.sum(sel.to(tl.int32), 0)
        n_ties += tl.sum(tie.to(tl.int32), 0)
    for start in range(0, k, BLOCK_K):
        col = start + tl.arange(0, BLOCK_K)
        tl.store(orow + col, tl.full([BLOCK_K], -1, tl.int32), mask=(col >= n_sel) & (col < k))


def launch_topk(
    scores: torch.Tensor,
    out: torch.Tensor,
    k: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    window: int = 0,
    forced_mask: torch.Tensor | None = None,
    token_offset: int = 0,
) -> torch.Tensor:
    """Select into ``out [rows, k]`` for query tokens ``token_offset ..`` whose score rows are ``scores``."""
    rows, num_cols = scores.shape
    if rows == 0:
        return out
    if num_cols > int(block_tables.shape[1]) * block_size:
        # The kernel reads block_tables[s, position // block_size]: keep it inside the table.
        raise ValueError(f"{num_cols} score columns exceed block table width x block size")
    if forced_mask is not None:
        forced = forced_mask.to(torch.uint8) if forced_mask.dtype != torch.uint8 else forced_mask
        forced_stride = forced.stride(0)
        # Columns past the mask's width are never forced: clip the scan rather than read out of bounds.
        if forced.shape[1] < num_cols:
            forced = torch.nn.functional.pad(forced, (0, num_cols - forced.shape[1]))
            forced_stride = forced.stride(0)
    else:
        forced, forced_stride = scores, 0
    _topk_kernel[(rows,)](
        scores, out, block_tables, block_tables.stride(0), seq_lens, query_start_loc, forced, forced_stride,
        int(seq_lens.shape[0]), token_offset, num_cols, window, k, scores.stride(0), out.stride(0),
        BLOCK_SIZE=block_size, BLOCK_N=min(1024, max(16, next_pow2(num_cols))), BLOCK_K=min(1024, next_pow2(k)),
        HAS_FORCED=forced_mask is not None,
    )  # fmt: skip
    return out


def topk_select(
    scores: torch.Tensor,
    k: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    window: int = 0,
    forced_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-``k`` slots per query row with the forced set; same semantics as ``torch_kernels.topk_select``.

    ``out`` (optional ``[T, k]`` int32) receives the result; every element is written.
    """
    check_device(scores, block_tables)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if out is None:
        out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    return launch_topk(scores, out, k, block_tables, seq_lens, query_start_loc, block_size, window, forced_mask)
