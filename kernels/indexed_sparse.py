"""Token-sparse attention driven by a trained lightning indexer (``engine/lightning.py``).

Per query token: indexer scores over every visible cached token (``score = sum_h w_h relu(qi_h . ki)``,
the index keys ``ki`` in their own paged int8 cache, same block ids as K/V), then the top
``k = top_k + forced`` positions with the forced set always in (``kernels/topk.py``'s contract: the
local window ``pos - window < p <= pos`` and the protected blocks' tokens), then attention over exactly
those tokens. Token granular: every query selects alone (prefill too), unlike the block_bounds path.

``k`` per sequence is ``top_k`` plus the forced tokens of its last query, so ``top_k`` never pays for
the forced set::

    seq_len 100, block_size 16, protected block 0, window 32, top_k 24
    forced   : tokens 0..15 (block 0) + 68..99 (window)   -> 48 tokens
    k        : 24 + 48 = 72 -> the 24 best-scoring of tokens 16..67 join the forced 48

Backends share the semantics (tested for identical selections): torch scores with
``lightning.scores``-equivalent einsums and selects with one stable sort per row chunk (ties -> lower
position, as ``reference.topk_select``); Triton runs ``kernels.indexer.indexer_topk`` (radix select,
bounded memory) and ``kernels.sparse_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.sparse import forced_tokens
from kernels.layout import NULL_BLOCK

# Scores of one row chunk (fp32 ``rows x N``) stay under this many bytes.
MEMORY_BUDGET = 64 << 20


@dataclass
class IndexCache:
    """One layer's index keys: ``keys int8 [num_blocks, block_size, Di]``, ``scale fp32 [num_blocks,
    block_size]`` (``kernels/indexer.py``'s int8 layout)."""

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


def _positions(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(seq_len - n, seq_len, device=device)


def select_torch(iq: torch.Tensor, iw: torch.Tensor, cache: IndexCache, table: torch.Tensor, seq_len: int,
                 forced_mask: torch.Tensor, k: int, window: int) -> torch.Tensor:
    """Selected flat slots ``[n, k]`` int32 (ascending position, -1 padded) of one sequence's ``n`` newest
    queries: ``iq [n, Hi, Di]``, ``iw [n, Hi]``, ``table [nb]`` its physical blocks, ``forced_mask
    [nb * block_size]`` its protected tokens."""
    n = iq.shape[0]
    bsz, di = cache.keys.shape[1], cache.keys.shape[2]
    cols = table.shape[0] * bsz
    p = torch.arange(cols, device=iq.device)
    slots = table.long()[p // bsz] * bsz + p % bsz
    keys = cache.keys.view(-1, di)[slots].float() * cache.scale.view(-1)[slots][:, None]  # [N, Di]
    pos = _positions(n, seq_len, iq.device)
    out = torch.full((n, k), -1, dtype=torch.int32, device=iq.device)
    rows = max(1, MEMORY_BUDGET // (4 * cols * max(1, iq.shape[1])))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        logits = torch.einsum("thd,pd->thp", iq[a:b].float(), keys).relu()
        score = (iw[a:b].float()[:, :, None] * logits).sum(1)  # [r, N]
        valid = (p[None, :] <= pos[a:b, None]) & (p[None, :] < seq_len) & (table.long()[p // bsz] != NULL_BLOCK)[None]
        forced = valid & ((p[None, :] > pos[a:b, None] - window) | forced_mask[None, :cols])
        key = torch.where(valid, score, float("-inf"))
        key = torch.where(forced, float("inf"), key)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
        ok = valid.gather(1, order)
        # Ascending positions, -1 padded (invalid picks of short rows sort last).
        ordered = torch.where(ok, order, cols).sort(dim=1).values
        chosen = torch.where(ordered < cols, slots[ordered.clamp(max=cols - 1)], -1)
        out[a:b, : chosen.shape[1]] = chosen.int()
    return out


def select_triton(iq: torch.Tensor, iw: torch.Tensor, cache: IndexCache, table: torch.Tensor, seq_len: int,
                  forced_mask: torch.Tensor, k: int, window: int) -> torch.Tensor:
    """``select_torch`` with ``kernels.indexer.indexer_topk`` (same contract)."""
    from kernels import indexer

    n = iq.shape[0]
    dev = iq.device
    bt = table.to(torch.int32)[None].contiguous()
    lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
    return indexer.indexer_topk(iq.float().contiguous(), iw.float().contiguous(), cache.keys, bt, lens, qsl, k,
                                window=window, forced_mask=forced_mask[None].to(torch.uint8),
                                idx_k_scale=cache.scale, num_cols=table.shape[0] * cache.keys.shape[1])


# Boolean mask elements (query rows x gathered keys) per attention call of ``attend_torch``.
MASK_BUDGET = 16 << 20


def attend_torch(query: torch.Tensor, kv, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``query [n, Hq, D]`` over its ``slots [n, k]``: the distinct selected blocks of all rows
    are gathered once (packed blocks dequantized) and every row attends them under a mask of its own
    slots (rows of one sequence select mostly the same blocks; one SDPA instead of a per-row gather)."""
    from kernels import block_sparse

    bsz = block_sparse.bounds_block_size(kv)
    n, hq, d = query.shape
    ok = slots >= 0
    blocks = torch.unique(slots[ok].long() // bsz)
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
    from kernels import sparse_attention as sa

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
    ``kernels.block_sparse.SparsePlan`` (forced blocks, ``top_blocks`` -1 = dense; ``top_k`` in tokens is
    ``plan.top_tokens``). ``selections`` (optional) receives each sequence's ``[n, k]`` slots.
    """
    bsz = cache.keys.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        r0, r1 = starts[s], starts[s + 1]
        if r1 == r0:
            continue
        nb = -(-seq_len // bsz)
        table = block_tables[s, :nb]
        forced_blocks = plan.forced[s, :nb]
        top = plan.top_blocks[s]
        if top < 0:
            k = seq_len  # dense: every visible token
        else:
            k = min(seq_len, plan.top_tokens + forced_tokens(forced_blocks.nonzero().flatten().tolist(), seq_len, bsz,
                                                             plan.window))
        forced_mask = forced_blocks.repeat_interleave(bsz)
        slots = select(iq[r0:r1], iw[r0:r1], cache, table, seq_len, forced_mask, k, plan.window)
        if selections is not None:
            selections.append(slots)
        out[r0:r1] = attend(query[r0:r1], kv, slots, scale)
    return out
