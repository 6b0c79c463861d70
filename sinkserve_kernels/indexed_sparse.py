"""Token-sparse attention driven by a trained lightning indexer (``engine/worker/lightning.py``).

Per query token: indexer scores over every visible cached token (``score = sum_h w_h relu(qi_h . ki)``,
the index keys ``ki`` in their own paged int8 cache, same block ids as K/V), then the top
``k = top_k + forced`` positions with the forced set always in (``sinkserve_kernels/topk.py``'s contract: the
local window ``pos - window < p <= pos`` and the protected blocks' tokens), then attention over exactly
those tokens. Token granular: every query selects alone (prefill too), unlike the block_bounds path.

``k`` per sequence is ``top_k`` plus the forced tokens of its last query, so ``top_k`` never pays for
the forced set::

    seq_len 100, block_size 16, protected block 0, window 32, top_k 24
    forced   : tokens 0..15 (block 0) + 68..99 (window)   -> 48 tokens
    k        : 24 + 48 = 72 -> the 24 best-scoring of tokens 16..67 join the forced 48

Backends share the semantics (tested for identical selections): torch scores with
``lightning.scores``-equivalent einsums and selects with one stable sort per row chunk (ties -> lower
position, as ``torch_kernels.topk_select``); Triton runs ``sinkserve_kernels.indexer.indexer_topk`` (radix select,
bounded memory) and ``sinkserve_kernels.sparse_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sinkserve_kernels.sparse_geometry import forced_tokens
from sinkserve_kernels.layout import NULL_BLOCK
from sinkserve_kernels.workspace import workspace

# Scores of one row chunk (fp32 ``rows x N``) stay under this many bytes.
MEMORY_BUDGET = 64 << 20


@dataclass
class IndexCache:
    """One layer's index keys: ``keys int8 [num_blocks, block_size, Di]``, ``scale fp32 [num_blocks,
    block_size]`` (``sinkserve_kernels/indexer.py``'s int8 layout)."""

    keys: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, dim: int, device: torch.device | str) -> "IndexCache":
        return cls(torch.zeros(num_blocks, block_size, dim, dtype=torch.int8, device=device),
                   torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device))

    def write(self, codes: torch.Tensor, scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``codes [T, Di]`` / ``scale [T]`` at flat slots (< 0: not stored)."""
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        self.keys.view(-1, self.keys.shape[-1])[slots] = codes[keep]
        self.scale.view(-1)[slots] = scale[keep]

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys[dst] = self.keys[src]
        self.scale[dst] = self.scale[src]


@dataclass(frozen=True)
class SeqRows:
    """One sequence's query rows in a step: rows ``r0:r1`` of the packed queries (the newest ``r1 - r0``
    positions of ``seq_len``), ``table [nb]`` its physical blocks, ``forced_mask [nb * block_size]`` its
    protected tokens, ``k`` its selection width (``top_k`` + the forced tokens of its last query)."""

    r0: int
    r1: int
    seq_len: int
    table: torch.Tensor
    forced_mask: torch.Tensor
    k: int


def _columns(seq: SeqRows, cache: IndexCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sequence's token columns: flat slots ``[N]``, dequantized index keys ``[N, Di]``, and whether the
    column holds a stored token (inside ``seq_len``, not in a null block) ``[N]``."""
    bsz, di = cache.keys.shape[1], cache.keys.shape[2]
    p = torch.arange(seq.table.shape[0] * bsz, device=seq.table.device)
    blocks = seq.table.long()[p // bsz]
    slots = blocks * bsz + p % bsz
    keys = cache.keys.view(-1, di)[slots].float() * cache.scale.view(-1)[slots][:, None]
    return slots, keys, (p < seq.seq_len) & (blocks != NULL_BLOCK)


def _pieces(seqs: list[SeqRows], cols: int, heads: int) -> list[list[tuple[int, int, int]]]:
    """Rows ``(sequence, a, b)`` packed into batches whose scores stay under ``MEMORY_BUDGET`` (a long
    prefill splits into several pieces; many decode rows share one batch)."""
    rows = max(1, MEMORY_BUDGET // (4 * max(1, cols) * max(1, heads)))
    batches: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for i, seq in enumerate(seqs):
        for a in range(seq.r0, seq.r1, rows):
            b = min(seq.r1, a + rows)
            if used + b - a > rows:
                batches.append([])
                used = 0
            batches[-1].append((i, a, b))
            used += b - a
    return [b for b in batches if b]


def select_top(key: torch.Tensor, valid: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row the ``k[row]`` largest ``key`` columns, ties to the lower column (a stable descending sort's
    first ``k``), invalid columns dropped: ``[R, N]`` bool. One ``topk`` for the threshold, not a sort::

        key [5, 9, 7, 9, 1], k 3 -> threshold 7: the two 9s (> 7) and the first 7 -> columns 1, 2, 3
    """
    n = key.shape[1]
    kk = k.clamp(max=n)
    kth = torch.empty(key.shape[0], 1, dtype=key.dtype, device=key.device)  # per row its k-th largest
    for width in kk.unique().tolist():  # one width per sequence; usually one per step
        rows = (kk == width).nonzero().flatten()
        kth[rows, 0] = key[rows].topk(width, dim=1, sorted=False).values.amin(1)
    above = key > kth
    tied = key == kth
    need = kk[:, None] - above.sum(1, keepdim=True)
    return (above | (tied & (tied.cumsum(1) <= need))) & valid


def select_torch(iq: torch.Tensor, iw: torch.Tensor, cache: IndexCache, seqs: list[SeqRows],
                 window: int) -> list[torch.Tensor]:
    """Selected flat slots ``[n, k]`` int32 (ascending position, -1 padded) of every sequence's rows:
    ``iq [T, Hi, Di]``, ``iw [T, Hi]``. Scores per sequence (one product over its columns), then the
    selection of every row of the step at once (``select_top``; ``MEMORY_BUDGET`` bounds a batch)."""
    out = [torch.full((s.r1 - s.r0, s.k), -1, dtype=torch.int32, device=iq.device) for s in seqs]
    if not seqs:
        return out
    bsz = cache.keys.shape[1]
    width = max(s.table.shape[0] for s in seqs) * bsz
    columns: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for batch in _pieces(seqs, width, iq.shape[1]):
        r = sum(b - a for _, a, b in batch)
        cols = max(seqs[i].table.shape[0] for i, _, _ in batch) * bsz
        key = torch.full((r, cols), float("-inf"), device=iq.device)
        valid = torch.zeros(r, cols, dtype=torch.bool, device=iq.device)
        slot = torch.zeros(r, cols, dtype=torch.long, device=iq.device)
        kr = torch.empty(r, dtype=torch.long, device=iq.device)
        at = 0
        for i, a, b in batch:
            seq = seqs[i]
            if i not in columns:
                columns = {i: _columns(seq, cache)}  # pieces of one sequence are consecutive
            slots, keys, stored = columns[i]
            n = slots.shape[0]
            p = torch.arange(n, device=iq.device)
            pos = torch.arange(seq.seq_len - (seq.r1 - a), seq.seq_len - (seq.r1 - b), device=iq.device)
            logits = torch.einsum("thd,pd->thp", iq[a:b].float(), keys).relu_()  # in place: no second [r, Hi, n]
            score = (iw[a:b].float()[:, :, None] * logits).sum(1)  # [rows, n]
            ok = stored[None, :] & (p[None, :] <= pos[:, None])
            forced = ok & ((p[None, :] > pos[:, None] - window) | seq.forced_mask[None, :n])
            rows = slice(at, at + b - a)
            key[rows, :n] = torch.where(forced, float("inf"), torch.where(ok, score, float("-inf")))
            valid[rows, :n] = ok
            slot[rows, :n] = slots
            kr[rows] = seq.k
            at += b - a
        chosen = select_top(key, valid, kr)
        # Ascending positions, -1 padded: the j-th chosen column of a row goes to its column j.
        kmax = int(kr.max())
        dest = torch.where(chosen, chosen.cumsum(1) - 1, kmax)
        picked = torch.full((r, kmax + 1), -1, dtype=torch.long, device=iq.device)
        picked.scatter_(1, dest, torch.where(chosen, slot, -1))
        at = 0
        for i, a, b in batch:
            seq = seqs[i]
            out[i][a - seq.r0 : b - seq.r0] = picked[at : at + b - a, : seq.k].int()
            at += b - a
    return out


def select_triton(iq: torch.Tensor, iw: torch.Tensor, cache: IndexCache, seqs: list[SeqRows],
                  window: int) -> list[torch.Tensor]:
    """``select_torch`` with ``sinkserve_kernels.indexer.indexer_topk`` (same contract), one launch per sequence
    (each has its own ``k``)."""
    from sinkserve_kernels import indexer

    out = []
    for seq in seqs:
        n = seq.r1 - seq.r0
        dev = iq.device
        bt = seq.table.to(torch.int32)[None].contiguous()
        lens = torch.tensor([seq.seq_len], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        out.append(indexer.indexer_topk(iq[seq.r0 : seq.r1].float().contiguous(), iw[seq.r0 : seq.r1].float().contiguous(),
                                        cache.keys, bt, lens, qsl, seq.k, window=window,
                                        forced_mask=seq.forced_mask[None].to(torch.uint8), idx_k_scale=cache.scale,
                                        num_cols=seq.table.shape[0] * cache.keys.shape[1]))
    return out


# Boolean mask elements (query rows x gathered keys) per attention call of ``attend_torch``.
MASK_BUDGET = 16 << 20


def attend_rows(query: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Attention of ``query [n, Hq, D]`` over its ``slots [n, k]`` with a per-row gather of exactly those
    tokens (16-bit caches): decode rows, whatever their sequences, in one SDPA."""
    n, hq, d = query.shape
    ok = slots >= 0
    flat = slots.long().clamp(min=0).flatten()
    hkv = kv[0].shape[2]
    # Token rows of a 2-D view (a 3-D index_select is slower on CPU), into buffers kept across layers and
    # steps (a fresh multi-MB tensor pays its page faults: sinkserve_kernels/workspace.py).
    ws = workspace()
    gathered = []
    for name, cache in (("ix_rows_k", kv[0]), ("ix_rows_v", kv[1])):
        buf = ws.get(name, (flat.numel(), hkv * d), cache.dtype, cache.device)
        torch.index_select(cache.view(-1, hkv * d), 0, flat, out=buf)
        gathered.append(buf.view(n, -1, hkv, d).transpose(1, 2).to(query.dtype))
    keys, values = gathered
    o = torch.nn.functional.scaled_dot_product_attention(query[:, :, None], keys, values, attn_mask=ok[:, None, None],
                                                         scale=scale, enable_gqa=hkv != hq)
    return torch.where(ok.any(1)[:, None, None], o[:, :, 0], torch.zeros_like(query))


def attend_torch(query: torch.Tensor, kv, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``query [n, Hq, D]`` over its ``slots [n, k]``. Rows of one prefill sequence select
    mostly the same blocks: the distinct selected blocks of all rows are gathered once (packed blocks
    dequantized) and every row attends them under a mask of its own slots. When that union holds more
    tokens than the rows' own selections together (decode rows, of one or many sequences), a 16-bit cache
    is read per row instead (``attend_rows``)."""
    from sinkserve_kernels import block_sparse

    bsz = block_sparse.bounds_block_size(kv)
    n, hq, d = query.shape
    ok = slots >= 0
    blocks = torch.unique(slots[ok].long() // bsz)
    if isinstance(kv, tuple) and n * slots.shape[1] < blocks.numel() * bsz:
        return attend_rows(query, kv, slots, scale)
    keys, values = block_sparse.gather_blocks(kv, blocks, query.dtype)  # [U, B, Hkv, D]
    u = blocks.numel() * bsz
    local = torch.searchsorted(blocks, slots.long().clamp(min=0) // bsz) * bsz + slots.long().clamp(min=0) % bsz
    local = torch.where(ok, local, u)  # the padding column, dropped below
    k = keys.reshape(1, u, -1, d).transpose(1, 2)
    v = values.reshape(1, u, -1, d).transpose(1, 2)
    out = torch.zeros_like(query)
    rows = max(1, MASK_BUDGET // max(1, u))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        mask = torch.zeros(b - a, u + 1, dtype=torch.bool, device=query.device)
        mask.scatter_(1, local[a:b], True)
        o = torch.nn.functional.scaled_dot_product_attention(
            query[a:b].transpose(0, 1)[None], k, v, attn_mask=mask[None, None, :, :u], scale=scale,
            enable_gqa=k.shape[1] != hq)
        out[a:b] = o[0].transpose(0, 1)
    # A row with no selected slot (none in practice: the query's own token is forced) returns zeros.
    return torch.where(ok.any(1)[:, None, None], out, torch.zeros_like(out))


def attend_triton(query: torch.Tensor, kv, slots: torch.Tensor, scale: float) -> torch.Tensor:
    from sinkserve_kernels import sparse_attention as sa

    if isinstance(kv, tuple):
        return sa.sparse_attention(query.contiguous(), kv[0], kv[1], slots, scale)
    return sa.sparse_attention_quant(query.contiguous(), kv, slots, scale)


Select = Callable[..., torch.Tensor]


def indexed_sparse_attention(query: torch.Tensor, kv, iq: torch.Tensor, iw: torch.Tensor, cache: IndexCache,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan,
                             scale: float, select: Select = select_torch, attend=attend_torch,
                             selections: list | None = None) -> torch.Tensor:
    """Attention of packed queries ``[T, Hq, D]`` over each sequence's forced + top-k tokens.

    ``iq [T, Hi, Di]`` / ``iw [T, Hi]`` are the layer's indexer queries and weights, ``plan`` the step's
    ``sinkserve_kernels.block_sparse.SparsePlan`` (forced blocks, ``top_blocks`` -1 = dense; ``top_k`` in tokens is
    ``plan.top_tokens``). ``selections`` (optional) receives each sequence's ``[n, k]`` slots. The step's
    rows select together (``select``); one-token (decode) sequences then attend in one ``attend`` call,
    each prefill sequence in its own (its rows share most of their blocks).
    """
    bsz = cache.keys.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    seqs: list[SeqRows] = []
    for s, seq_len in enumerate(seq_lens.tolist()):
        r0, r1 = starts[s], starts[s + 1]
        if r1 == r0:
            continue
        nb = -(-seq_len // bsz)
        forced_blocks = plan.forced[s, :nb]
        if plan.top_blocks[s] < 0:
            k = seq_len  # dense: every visible token
        else:
            k = min(seq_len, plan.top_tokens + forced_tokens(forced_blocks.nonzero().flatten().tolist(), seq_len, bsz,
                                                             plan.window))
        seqs.append(SeqRows(r0, r1, seq_len, block_tables[s, :nb], forced_blocks.repeat_interleave(bsz), k))
    chosen = select(iq, iw, cache, seqs, plan.window)
    if selections is not None:
        selections.extend(chosen)
    decode = [i for i, seq in enumerate(seqs) if seq.r1 - seq.r0 == 1]
    if decode:
        rows = torch.tensor([seqs[i].r0 for i in decode], device=query.device)
        width = max(chosen[i].shape[1] for i in decode)
        slots = torch.cat([torch.nn.functional.pad(chosen[i], (0, width - chosen[i].shape[1]), value=-1)
                           for i in decode])
        out[rows] = attend(query[rows], kv, slots, scale)
    for i, seq in enumerate(seqs):
        if seq.r1 - seq.r0 > 1:
            out[seq.r0 : seq.r1] = attend(query[seq.r0 : seq.r1], kv, chosen[i], scale)
    return out
