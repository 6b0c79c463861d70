"""Torch reference kernels: the ground truth the Triton kernels are tested against.

KV layout shared by every kernel (one pair of tensors per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    block_tables[s] = [ 7 | 0 | 0 | 12 | 3 ]      block 0 is the null block: its entries are skipped
                        |               |           (evicted spans), so tables stay positional
           logical tokens 0..15      48..63

A sequence ``s`` has ``seq_lens[s]`` logical tokens in cache *including* the ``q_len`` new tokens of this
forward; its queries sit at logical positions ``seq_lens[s] - q_len .. seq_lens[s] - 1`` and attend
causally to every non-null logical position at or before their own.

Queries of all sequences are packed on one token axis (prefill chunks and decode tokens together);
``query_start_loc`` (length S + 1) marks where each sequence's queries begin.
"""

from __future__ import annotations

import torch

from kernels.layout import NULL_BLOCK


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into the caches at flat slots ``block * block_size + offset``.

    Slots < 0 are skipped (tokens whose KV must not be stored).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather each sequence's cached keys/values, skipping null blocks.

    Returns ``keys, values [S, L, Hkv, D]``, a validity mask ``[S, L]`` and the logical position of each
    gathered key ``[S, L]``. Only non-null blocks are gathered, so a long stream whose table is mostly
    null costs what its kept blocks cost, not what its whole history would.
    """
    block_size = k_cache.shape[1]
    num_table_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_table_blocks].long()
    live = table != NULL_BLOCK
    # Stable sort moves each row's live blocks to the front, in logical order.
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)
    width = max(int(live.sum(dim=1).max()), 1)
    order = order[:, :width]
    compact = table.gather(1, order)
    # index_select on a [num_blocks, block_size * Hkv * D] view: ~2x faster than advanced indexing on CPU.
    flat = compact.flatten()
    keys = k_cache.flatten(1).index_select(0, flat).view(compact.shape[0], width * block_size, *k_cache.shape[2:])
    values = v_cache.flatten(1).index_select(0, flat).view(compact.shape[0], width * block_size, *v_cache.shape[2:])
    offsets = torch.arange(block_size, device=k_cache.device)
    positions = (order[:, :, None] * block_size + offsets).flatten(1)
    valid = (positions < seq_lens[:, None].long()) & (compact != NULL_BLOCK).repeat_interleave(block_size, dim=1)
    return keys, values, valid, positions


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, Hq, D]`` over paged caches; returns ``[T, Hq, D]``.

    Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    """
    num_seqs = int(seq_lens.shape[0])
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]

    decode = [i for i in range(num_seqs) if q_lens[i] == 1]
    if decode:
        # Single-token queries batch into one call: padding only along the key axis, and every valid
        # key precedes the query, so no causal mask is needed.
        idx = torch.tensor(decode, dtype=torch.long, device=query.device)
        keys, values, valid, _ = gather_kv(k_cache, v_cache, block_tables[idx], seq_lens[idx])
        tok = query_start_loc[idx].long()
        # Fold each KV head's query heads into the query-row axis: [B, Hkv, Hq/Hkv, D]. With one query token
        # per sequence that is exact (no causal mask), and SDPA then reads K/V once per KV head instead of
        # expanding them Hq/Hkv times (enable_gqa) from a strided transpose.
        q = query[tok].unflatten(1, (keys.shape[2], -1))
        k = keys.transpose(1, 2).to(q.dtype)
        v = values.transpose(1, 2).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
        out[tok] = o.flatten(1, 2)
    for i in range(num_seqs):
        n = q_lens[i]
        if n <= 1:
            continue
        keys, values, valid, k_pos = gather_kv(k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1])
        q_pos = torch.arange(lens[i] - n, lens[i], device=query.device)
        mask = valid[:, None, :] & (k_pos[:, None, :] <= q_pos[None, :, None])
        q = query[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        o = _sdpa(q, keys, values, mask[:, None, :, :], scale)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, Hq, n, D]`` against ``keys/values [B, L, Hkv, D]`` with a boolean ``mask`` broadcastable to scores."""
    k = keys.transpose(1, 2)
    v = values.transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


# --------------------------------------------------------------------------------------------------------
# References for the Triton kernels of issue 6 (quantized KV, lightning indexer, top-k, sparse attention).
# --------------------------------------------------------------------------------------------------------


def quantize_blocks(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, ...]:
    """Asymmetric quantization of whole blocks ``[n, B, H, D]`` (layout of ``kernels.kv_quant``).

    Keys: one (scale, zero) per channel over the block's tokens -> ``[n, H, D]``. Values: one per token per
    ``group_size`` channels -> ``[n, B, H, D / G]``. Scales/zeros are rounded to fp16 first and the codes
    computed against the rounded values. Returns unpacked codes ``(kc, ks, kz, vc, vs, vz)`` (codes as float).
    """
    qmax = (1 << bits) - 1
    k = k_blocks.float()
    kz = k.amin(1).half().float()
    ks = ((k.amax(1) - kz) / qmax).half().float()
    kc = ((k - kz[:, None]) / torch.where(ks > 0, ks, 1.0)[:, None] + 0.5).floor().clamp(0, qmax)
    v = v_blocks.float().unflatten(-1, (-1, group_size))
    vz = v.amin(-1).half().float()
    vs = ((v.amax(-1) - vz) / qmax).half().float()
    vc = ((v - vz[..., None]) / torch.where(vs > 0, vs, 1.0)[..., None] + 0.5).floor().clamp(0, qmax).flatten(-2)
    return kc, ks, kz, vc, vs, vz


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., D]`` codes in 0..15 into ``[..., D/2]`` bytes: low nibble channel c, high nibble c + D/2."""
    half = codes.shape[-1] // 2
    c = codes.to(torch.uint8)
    return c[..., :half] | (c[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[..., D/2]`` bytes -> ``[..., D]`` codes (uint8)."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def dequantize_cache(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Full fp32 ``(k_cache, v_cache) [NB, B, H, D]`` of a ``kv_quant.QuantKVCache``: 16-bit-resident blocks
    (``fp_index >= 0``) come from the 16-bit pool, the others are dequantized ``code * scale + zero``."""
    kc, vc = cache.k_codes, cache.v_codes
    if cache.bits == 4:
        kc, vc = unpack_int4(kc), unpack_int4(vc)
    g = cache.group_size
    k = kc.float() * cache.k_scale.float()[:, None] + cache.k_zero.float()[:, None]
    vs = cache.v_scale.float().repeat_interleave(g, dim=-1)
    vz = cache.v_zero.float().repeat_interleave(g, dim=-1)
    v = vc.float() * vs + vz
    fp = cache.fp_index.long()
    is_fp = fp >= 0
    k[is_fp] = cache.fp_k[fp[is_fp]].float()
    v[is_fp] = cache.fp_v[fp[is_fp]].float()
    return k, v


def _token_positions(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed query token: its sequence index and its logical position."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens), device=seq_lens.device), q_lens)
    local = torch.arange(int(q_lens.sum()), device=seq_lens.device) - query_start_loc[:-1].long()[seq_of]
    pos = seq_lens.long()[seq_of] - q_lens[seq_of] + local
    return seq_of, pos


def _visible(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int, num_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T, N]`` mask of the logical positions each query may see (causal, in length, not null) and the
    ``[T, N]`` flat slot of every position, plus per-token sequence index."""
    seq_of, pos = _token_positions(seq_lens, query_start_loc)
    p = torch.arange(num_cols, device=seq_lens.device)
    table = block_tables.long()[seq_of][:, torch.clamp(p // block_size, max=block_tables.shape[1] - 1)]
    in_table = (p // block_size < block_tables.shape[1])[None, :]
    valid = in_table & (p[None, :] <= pos[:, None]) & (p[None, :] < seq_lens.long()[seq_of][:, None]) & (table != NULL_BLOCK)
    slots = table * block_size + p[None, :] % block_size
    return valid, slots, seq_of


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx_k_scale: torch.Tensor | None = None,
    num_cols: int | None = None,
) -> torch.Tensor:
    """Lightning-indexer scores ``[T, N]``: ``sum_h w[t, h] * relu(q[t, h] . k[p])`` for every logical position.

    ``q [T, Hi, Di]``, ``weights [T, Hi]``; ``idx_k_cache [NB, B, Di]`` is one small key per cached token
    (any float dtype, or int8 with per-token ``idx_k_scale [NB, B]``). Invisible positions (after the query,
    past the sequence, null block) score ``-inf``. ``N`` defaults to the block-table width x block size.
    """
    num_blocks, block_size, di = idx_k_cache.shape
    n = num_cols if num_cols is not None else block_tables.shape[1] * block_size
    keys = idx_k_cache.float()
    if idx_k_scale is not None:
        keys = keys * idx_k_scale.float()[..., None]
    valid, slots, _ = _visible(block_tables, seq_lens, query_start_loc, block_size, n)
    k = keys.view(-1, di)[slots.clamp(min=0, max=num_blocks * block_size - 1)]  # [T, N, Di]
    logits = torch.einsum("thd,tnd->thn", q.float(), k).relu()
    scores = (weights.float()[:, :, None] * logits).sum(1)
    return scores.masked_fill(~valid, float("-inf"))


def topk_select(
    scores: torch.Tensor,
    k: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    window: int = 0,
    forced_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query row: the ``k`` visible positions with the highest score, always including the forced set.

    Forced = visible positions in the local ``window`` (``pos - window < p <= pos``) or marked in
    ``forced_mask [S, N]`` (protected tokens). Rows with <= ``k`` visible positions select all of them.
    Ties (including among forced positions when there are more than ``k``) go to the lower position.
    Returns ``[T, k]`` int32 physical slots ``block_id * block_size + offset`` in ascending position order,
    padded with -1.
    """
    num_tokens, n = scores.shape
    valid, slots, seq_of = _visible(block_tables, seq_lens, query_start_loc, block_size, n)
    _, pos = _token_positions(seq_lens, query_start_loc)
    p = torch.arange(n, device=scores.device)
    forced = p[None, :] > (pos[:, None] - window)
    if forced_mask is not None:
        forced = forced | forced_mask[seq_of, :n].bool()
    forced = forced & valid
    key = torch.where(valid, scores.float(), float("-inf"))
    key = torch.where(forced, float("inf"), key)
    out = torch.full((num_tokens, k), -1, dtype=torch.int32, device=scores.device)
    for t in range(num_tokens):
        nvalid = int(valid[t].sum())
        if nvalid <= k:
            chosen = valid[t].nonzero().flatten()
        else:
            order = torch.sort(key[t], descending=True, stable=True).indices
            chosen = order[:k].sort().values
        out[t, : len(chosen)] = slots[t, chosen].int()
    return out


def sparse_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query token ``[T, Hq, D]`` over only its selected flat ``slots [T, K]`` (-1 = none).

    GQA as in ``paged_attention``. A row with no selected slot returns zeros.
    """
    num_blocks, block_size, hkv, d = k_cache.shape
    flat_k = k_cache.reshape(-1, hkv, d)
    flat_v = v_cache.reshape(-1, hkv, d)
    idx = slots.long().clamp(min=0)
    keys, values = flat_k[idx], flat_v[idx]  # [T, K, Hkv, D]
    valid = slots >= 0
    out = _sdpa(query.unsqueeze(2), keys, values, valid[:, None, None, :], scale).squeeze(2)
    return torch.where(valid.any(1)[:, None, None], out, torch.zeros_like(out))
