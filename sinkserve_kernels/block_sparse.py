"""Block-sparse attention with a training-free block indexer (Quest's bounds), over 16-bit or packed KV.

Stage 1, the indexer: every cached block keeps, per layer and KV head, the per-channel min and max of
its keys (``BlockBounds``, same block ids as the paged cache). For a query ``q`` the largest score any
key of block ``b`` can reach is bounded by::

    ub(q, b) = sum_c max(q_c * kmin[b, c], q_c * kmax[b, c]) = relu(q) . kmax[b] + min(q, 0) . kmin[b]

(two matrix products, no per-key work). Per query head the bounds become a distribution over blocks
(``softmax(scale * ub)`` over the candidate blocks), summed over heads: one selection per query token
shared by every head, the estimate of the head-summed attention mass a block can hold.

Stage 2, the selection: the forced set (protected blocks, the blocks of the newest ``window`` tokens
before the query) plus the ``top_blocks`` best candidates. Attention then runs over the selected blocks
only, causally. Decode tokens select alone; a prefill chunk's queries select in groups of
``PREFILL_GROUP`` consecutive tokens that share one selection, scored with the group's mean query (the
group's own blocks are in its forced window).

Example (block_size 4, window 4, top_blocks 1, protected {0}), one decode query at position 21::

    blocks          0     1     2     3     4     5
    visible         y     y     y     n(null) y   y        (block 5 holds 20, 21)
    forced          P                        W     W       window: blocks (22 - 4) // 4 = 4 .. 5
    ub scores       -    0.1   2.3    -      -     -       -> top 1 of {1, 2}: block 2
    attended        0, 2, 4, 5  -> 14 tokens of 18 visible

Bounds upkeep: a write into a block at offset 0 starts the block afresh (a reused block forgets its old
owner's keys); later writes widen the bounds. Copies (copy-on-write) copy bounds; rotations (retention's
RoPE shift of kept blocks) recompute them from the rotated keys. Bounds of packed blocks are those of the
16-bit keys they were packed from: selection only, never attention, reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sinkserve_kernels.sparse_geometry import PREFILL_GROUP
from sinkserve_kernels.layout import NULL_BLOCK

__all__ = ["PREFILL_GROUP"]  # re-exported: the kernels' default group (sinkserve_kernels/sparse_geometry.py says why 128)
# Gathered K/V per chunk of query groups (bytes): bounds the memory of a long prefill's attention.
MEMORY_BUDGET = 64 << 20


@dataclass
class BlockBounds:
    """Per-channel key bounds of every cached block of one layer, head-major: ``packed [Hkv, num_blocks, 2,
    D]`` holds ``kmax`` then ``kmin``, so a sequence's bounds gather into one contiguous ``[Hkv, N, 2D]``
    operand and one matrix product per KV head scores a query against both (``kmin``/``kmax``: views)."""

    packed: torch.Tensor

    @property
    def kmax(self) -> torch.Tensor:
        """``[num_blocks, Hkv, D]`` view."""
        return self.packed[:, :, 0].transpose(0, 1)

    @property
    def kmin(self) -> torch.Tensor:
        """``[num_blocks, Hkv, D]`` view."""
        return self.packed[:, :, 1].transpose(0, 1)

    @classmethod
    def allocate(cls, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> "BlockBounds":
        return cls(torch.zeros(num_kv_heads, num_blocks, 2, head_dim, dtype=dtype, device=device))

    @classmethod
    def of(cls, kmin: torch.Tensor, kmax: torch.Tensor) -> "BlockBounds":
        """Bounds from ``kmin, kmax [num_blocks, Hkv, D]`` (tests, evals)."""
        return cls(torch.stack([kmax, kmin], dim=2).transpose(0, 1).contiguous())


@dataclass(frozen=True)
class SparsePlan:
    """One forward's selection rules (the same for every layer).

    ``forced [S, W]`` marks each sequence's protected logical blocks (W = block-table width);
    ``top_blocks[s]`` is the number of blocks the indexer adds for sequence ``s`` (-1: dense, attend every
    visible block); ``window`` tokens before each query (group) are forced as well. ``top_tokens``: the
    budget in tokens (the token-granular trained indexer, ``sinkserve_kernels/indexed_sparse.py``).
    """

    forced: torch.Tensor
    top_blocks: list[int]
    window: int
    prefill_group: int = PREFILL_GROUP
    top_tokens: int = 0


def update_bounds(bounds: BlockBounds, key: torch.Tensor, slot_mapping: torch.Tensor, block_size: int) -> None:
    """Fold new keys ``[T, Hkv, D]`` written at flat ``slot_mapping`` (< 0: not stored) into their blocks'
    bounds; a block written at offset 0 is reset first."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, slot_mapping = key[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    blk = slot_mapping.long() // block_size
    fresh = blk[slot_mapping.long() % block_size == 0]
    if fresh.numel():
        bounds.packed[:, fresh, 1] = float("inf")
        bounds.packed[:, fresh, 0] = float("-inf")
    # Per written block: lay its new keys out at their offsets (the rest +-inf) and reduce over the offsets
    # -- plain copies and a dense min/max, several times faster on CPU than scatter_reduce's amin/amax.
    ids, inv = torch.unique(blk, return_inverse=True)
    off = slot_mapping.long() % block_size
    k = key.to(bounds.packed.dtype)
    buf = k.new_full((ids.numel(), block_size, *k.shape[1:]), float("inf"))
    buf[inv, off] = k
    new_min = buf.amin(1).transpose(0, 1)  # [Hkv, n, D]
    buf.fill_(float("-inf"))
    buf[inv, off] = k
    new_max = buf.amax(1).transpose(0, 1)
    bounds.packed[:, ids, 1] = torch.minimum(bounds.packed[:, ids, 1], new_min)
    bounds.packed[:, ids, 0] = torch.maximum(bounds.packed[:, ids, 0], new_max)


def copy_bounds(bounds: BlockBounds, src: torch.Tensor, dst: torch.Tensor) -> None:
    bounds.packed[:, dst] = bounds.packed[:, src]


def set_bounds(bounds: BlockBounds, block_ids: torch.Tensor, keys: torch.Tensor) -> None:
    """Bounds of whole blocks from their keys ``[n, block_size, Hkv, D]`` (after a rotation)."""
    bounds.packed[:, block_ids] = torch.stack([keys.amax(1), keys.amin(1)], dim=2).transpose(0, 1).to(bounds.packed.dtype)


def gather_blocks(kv, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n, block_size, Hkv, D]`` of physical blocks, from ``(k_cache, v_cache)`` or a
    ``kv_quant.QuantKVCache`` (packed blocks decoded, 16-bit ones read from the side pool)."""
    if isinstance(kv, tuple):
        k_cache, v_cache = kv
        return k_cache.index_select(0, block_ids).to(dtype), v_cache.index_select(0, block_ids).to(dtype)
    from sinkserve_kernels import packed_decode

    shape = (block_ids.numel(), kv.block_size, kv.num_kv_heads, kv.head_dim)
    keys = torch.empty(shape, dtype=dtype, device=block_ids.device)
    values = torch.empty(shape, dtype=dtype, device=block_ids.device)
    packed_decode.dequantize_packed_into(kv, block_ids, keys, values)
    slot = kv.fp_index.index_select(0, block_ids).long()
    rows = (slot >= 0).nonzero().flatten()
    if rows.numel():
        keys.index_copy_(0, rows, kv.fp_k.index_select(0, slot[rows]).to(dtype))
        values.index_copy_(0, rows, kv.fp_v.index_select(0, slot[rows]).to(dtype))
    return keys, values


def block_scores(q: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
    """Quest upper bounds ``scale * ub`` per (query row, query head, block): ``q [G, Hq, D]``, ``bounds
    [Hkv, N, 2, D]`` (kmax, kmin) -> ``[G, Hq, N]`` (GQA: query head h reads KV head h // (Hq / Hkv)).
    ``ub = [relu(q), min(q, 0)] . [kmax, kmin]``: one batched product per KV head."""
    g, hq, d = q.shape
    hkv, n = bounds.shape[:2]
    qf = q.float().view(g, hkv, hq // hkv, d)
    qq = torch.cat([qf.clamp(min=0), qf.clamp(max=0)], dim=-1)  # [G, Hkv, r, 2D]
    qq = qq.permute(1, 0, 2, 3).reshape(hkv, -1, 2 * d)  # [Hkv, G*r, 2D]
    # bounds @ q^T, the bounds' rows streamed in order: ~3x faster on CPU than q @ bounds^T for a decode
    # token (a matrix-vector product over every block's bounds: the O(context) part of a decode step).
    ub = torch.matmul(bounds.float().view(hkv, n, 2 * d), qq.transpose(1, 2))  # [Hkv, N, G*r]
    return (ub * scale).view(hkv, n, g, hq // hkv).permute(2, 0, 3, 1).reshape(g, hq, n)


Score = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def select_blocks(q_groups: torch.Tensor, bounds: BlockBounds, table: torch.Tensor, forced_row: torch.Tensor,
                  first_pos: torch.Tensor, last_pos: torch.Tensor, top_blocks: int, window: int, block_size: int,
                  scale: float, score: Score = block_scores) -> torch.Tensor:
    """Selected logical blocks ``[G, N]`` (bool) of one sequence's query groups.

    ``q_groups [G, Hq, D]`` (one representative query per group), ``table [N]`` physical ids of the
    sequence's logical blocks, ``forced_row [N]`` its protected blocks, ``first_pos / last_pos [G]`` the
    positions of each group's first and last query. ``top_blocks < 0``: every visible block. ``score``
    maps ``(q_groups, bounds, scale)`` to per-head block logits ``[G, Hq, N]`` (``block_scores``; the
    evals swap in a random control); ``bounds`` arrive gathered in logical order ``[Hkv, N, 2, D]``.
    """
    n = table.shape[0]
    j = torch.arange(n, device=table.device)
    visible = (j[None, :] * block_size <= last_pos[:, None]) & (table != NULL_BLOCK)[None, :]
    if top_blocks < 0:
        return visible
    first_window = (first_pos - window + 1).clamp(min=0) // block_size
    forced = visible & (forced_row[None, :] | (j[None, :] >= first_window[:, None]))
    cand = visible & ~forced
    if top_blocks == 0 or not bool(cand.any()):
        return forced
    ids = table.long()
    if 2 * n >= bounds.packed.shape[1]:
        # The sequence spans most of the cache: score every physical block in place and pick its columns,
        # rather than copy its bounds first (decode is bound by the bytes it reads).
        logits = score(q_groups, bounds.packed, scale).index_select(2, ids)
    else:
        logits = score(q_groups, bounds.packed.index_select(1, ids), scale)
    logits = logits.masked_fill(~cand[:, None, :], float("-inf"))
    prob = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(1)  # [G, N] head-summed mass estimate
    prob = prob.masked_fill(~cand, -1.0)
    top = prob.topk(min(top_blocks, n), dim=-1).indices
    chosen = torch.zeros_like(cand).scatter_(1, top, True) & cand
    return forced | chosen


# attend(query_rows [R, Hq, D], q_pos [R], keys/values from the selected blocks) backends below.
Attend = Callable[..., torch.Tensor]


def _compact(sel: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected logical block indices first, in logical order: ``(order [G, M], valid [G, M])``."""
    m = max(1, int(sel.sum(1).max()))
    order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True)[:, :m]
    return order, sel.gather(1, order)


def attend_gather(query: torch.Tensor, q_pos: torch.Tensor, kv, table: torch.Tensor, sel: torch.Tensor,
                  seq_len: int, block_size: int, group: int, scale: float) -> torch.Tensor:
    """Torch path: per query group, gather its selected blocks once and run SDPA with a causal mask.
    ``query [n, Hq, D]`` (n <= G * group rows), ``q_pos [n]``, ``sel [G, N]`` -> ``[n, Hq, D]``."""
    n, hq, d = query.shape
    g = sel.shape[0]
    order, valid = _compact(sel, block_size)
    m = order.shape[1]
    offs = torch.arange(block_size, device=query.device)
    pos = (order[:, :, None] * block_size + offs).flatten(1)  # [G, M*B]
    kvalid = valid.repeat_interleave(block_size, dim=1) & (pos < seq_len)
    pad = g * group - n
    qp = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, pad)).view(g, group, hq, d)
    # Padded query rows take the last real position so their mask is never empty (their output is dropped).
    qpos = torch.cat([q_pos, q_pos[-1:].expand(pad)]).view(g, group)
    out = torch.empty(g, group, hq, d, dtype=query.dtype, device=query.device)
    hkv = (kv[0] if isinstance(kv, tuple) else kv.fp_k).shape[2]
    per_group = max(1, m * block_size * hkv * d * 2 * query.element_size())
    step = max(1, MEMORY_BUDGET // per_group)
    phys = table.long()[order] * valid
    # 16-bit caches gather into two buffers reused by every step: a fresh multi-MB tensor per step costs
    # page faults on first touch (measured ~2x the copy itself on the latency bench's 32K prefill).
    reuse = isinstance(kv, tuple) and kv[0].dtype == query.dtype
    if reuse:
        kbuf = torch.empty(min(step, g) * m, block_size, hkv, d, dtype=query.dtype, device=query.device)
        vbuf = torch.empty_like(kbuf)
    for a in range(0, g, step):
        b = min(g, a + step)
        ids = phys[a:b].flatten()
        if reuse:
            keys = torch.index_select(kv[0], 0, ids, out=kbuf[: ids.numel()])
            values = torch.index_select(kv[1], 0, ids, out=vbuf[: ids.numel()])
        else:
            keys, values = gather_blocks(kv, ids, query.dtype)
        keys = keys.view(b - a, m * block_size, hkv, d).transpose(1, 2)
        values = values.view(b - a, m * block_size, hkv, d).transpose(1, 2)
        mask = kvalid[a:b, None, :] & (pos[a:b, None, :] <= qpos[a:b, :, None])  # [g, group, M*B]
        o = torch.nn.functional.scaled_dot_product_attention(
            qp[a:b].transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=hkv != hq)
        out[a:b] = o.transpose(1, 2)
    return out.view(g * group, hq, d)[:n]


def selection_slots(q_pos: torch.Tensor, table: torch.Tensor, sel: torch.Tensor, seq_len: int, block_size: int,
                    group: int) -> torch.Tensor:
    """Per query row, the flat cache slots of its group's selected blocks at or before its position
    (``[n, M * block_size]`` int32, -1 padded): the selection in ``sinkserve_kernels.sparse_attention``'s terms."""
    order, valid = _compact(sel, block_size)
    offs = torch.arange(block_size, device=table.device)
    pos = (order[:, :, None] * block_size + offs).flatten(1)
    slots = (table.long()[order][:, :, None] * block_size + offs).flatten(1)
    ok = valid.repeat_interleave(block_size, dim=1) & (pos < seq_len)
    rows = torch.arange(q_pos.shape[0], device=table.device) // group
    ok_r = ok[rows] & (pos[rows] <= q_pos[:, None])
    return torch.where(ok_r, slots[rows], -1).to(torch.int32)


def attend_slots_triton(query: torch.Tensor, q_pos: torch.Tensor, kv, table: torch.Tensor, sel: torch.Tensor,
                        seq_len: int, block_size: int, group: int, scale: float) -> torch.Tensor:
    """Triton path: the selection as per-token slots, attended by ``sinkserve_kernels.sparse_attention``."""
    from sinkserve_kernels import sparse_attention as sa

    slots = selection_slots(q_pos, table, sel, seq_len, block_size, group)
    if isinstance(kv, tuple):
        return sa.sparse_attention(query.contiguous(), kv[0], kv[1], slots, scale)
    return sa.sparse_attention_quant(query.contiguous(), kv, slots, scale)


@dataclass(frozen=True)
class PagedDecode:
    """A backend's paged attention run over compacted block tables: every decode token of a step attends
    its selected blocks in one call, read straight from the cache (``cpu``: the C decode kernel), instead
    of a per-sequence gather. ``paged`` / ``paged_quant``: the backend's ``paged_attention`` and
    ``paged_attention_quant``.

    A decode query at position 40 (seq_len 41, block_size 8: block 5 holds only position 40) that selected
    logical blocks 0, 2 and 5 attends the table ``[phys(0), phys(2), phys(5)]`` with length
    ``2 * 8 + (41 - 5 * 8) = 17``: exactly the 17 selected tokens (only the last block can be partial).
    """

    paged: Callable[..., torch.Tensor]
    paged_quant: Callable[..., torch.Tensor]

    def __call__(self, query: torch.Tensor, kv, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
        qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        if isinstance(kv, tuple):
            return self.paged(query, kv[0], kv[1], tables, lens, qsl, scale)
        return self.paged_quant(query, kv, tables, lens, qsl, scale)


def block_sparse_attention(query: torch.Tensor, kv, bounds: BlockBounds, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: SparsePlan, scale: float,
                           attend: Attend = attend_gather, selections: list | None = None,
                           score: Score = block_scores, score_query: torch.Tensor | None = None,
                           paged: PagedDecode | None = None) -> torch.Tensor:
    """Attention of packed queries ``[T, Hq, D]`` over each sequence's forced + selected blocks.

    ``kv`` is ``(k_cache, v_cache)`` or a ``QuantKVCache``; ``attend`` is the backend's attention over a
    selection (``attend_gather``: torch; ``attend_slots_triton``). ``paged`` (optional): decode tokens of
    every sequence attend their selections in one paged call over compacted tables (``PagedDecode``).
    ``selections`` (optional list) receives each sequence's ``[G, N]`` selection, for tests and evals.
    ``score_query`` (``[T, Hq, D]``, default ``query``): the queries the blocks are scored with (selected
    memory scores position-free queries and attends the real ones).
    """
    block_size = bounds_block_size(kv)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode: list[tuple[int, torch.Tensor, int]] = []  # (row, physical blocks in logical order, tokens)
    for s, seq_len in enumerate(lens):
        r0, r1 = starts[s], starts[s + 1]
        n = r1 - r0
        if n == 0:
            continue
        nb = -(-seq_len // block_size)
        table = block_tables[s, :nb]
        group = 1 if n == 1 else plan.prefill_group
        g = -(-n // group)
        q = query[r0:r1]
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
        first = q_pos[::group]
        last = q_pos[torch.clamp(torch.arange(1, g + 1, device=query.device) * group, max=n) - 1]
        qs = q if score_query is None else score_query[r0:r1]
        if group == 1:
            q_groups = qs
        else:
            pad = g * group - n
            qp = torch.nn.functional.pad(qs.float(), (0, 0, 0, 0, 0, pad)).view(g, group, *q.shape[1:])
            counts = torch.clamp(n - torch.arange(g, device=query.device) * group, max=group).float()
            q_groups = qp.sum(1) / counts[:, None, None]
        sel = select_blocks(q_groups, bounds, table, plan.forced[s, :nb], first, last, plan.top_blocks[s],
                            plan.window, block_size, scale, score)
        if selections is not None:
            selections.append(sel)
        if paged is not None and n == 1:
            picked = sel[0].nonzero().flatten()  # logical order; the partial last block, if picked, is last
            last = int(picked[-1])
            tokens = (picked.numel() - 1) * block_size + min(block_size, seq_len - last * block_size)
            decode.append((r0, table[picked], tokens))
            continue
        out[r0:r1] = attend(q, q_pos, kv, table, sel, seq_len, block_size, group, scale)
    if decode:
        rows = torch.tensor([r for r, _, _ in decode], device=query.device)
        tables = torch.zeros(len(decode), max(ids.numel() for _, ids, _ in decode), dtype=torch.int32,
                             device=query.device)
        for i, (_, ids, _) in enumerate(decode):
            tables[i, : ids.numel()] = ids
        tokens = torch.tensor([t for _, _, t in decode], dtype=torch.int32, device=query.device)
        out[rows] = paged(query[rows], kv, tables, tokens, scale)
    return out


def bounds_block_size(kv) -> int:
    return int(kv[0].shape[1]) if isinstance(kv, tuple) else int(kv.block_size)
