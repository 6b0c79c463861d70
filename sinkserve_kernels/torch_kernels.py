"""The torch kernels: every kernel entry point in plain torch. Two jobs, one code: the ``torch`` backend
(and the ``cpu`` backend's base, which replaces its one-token decode attention with a C kernel), and the
ground truth the Triton and C kernels are tested against.

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

Two per-layer options of the model (``engine/worker/architectures.py``) change what a query sees:

* ``window`` (a sliding-window layer): a query at position ``q`` sees keys at ``q - window < k <= q``
  only, the last ``window`` positions including its own (transformers' ``sliding_window``)::

      window 4, query at 9:   keys 0 1 2 3 4 5 [6 7 8 9] 10 ...
                                                ^ visible

* ``sinks [Hq]`` (gpt-oss's learned sinks): one extra logit per query head in the softmax denominator
  with no value, so a head can put weight "nowhere"::

      p_j = exp(s_j) / (exp(sink_h) + sum_i exp(s_i)),   out = sum_j p_j v_j

  A query with no visible key outputs zeros, with or without sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sinkserve_kernels.layout import NULL_BLOCK
from sinkserve_kernels import packed_decode
from sinkserve_kernels.packed_decode import dequantize_packed_into


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


@dataclass(frozen=True)
class Gather:
    """Where a group of ``S`` sequences' cached keys live: each row's live (non-null) blocks moved to the
    front in logical order, ``W`` wide::

        block_tables [[7, 0, 12], [3, 5, 0]] (B = 16, seq_lens [40, 20])
        -> blocks [7, 12, 3, 5] (S * W, row-major), W = 2
           positions [[0..15, 32..47], [0..15, 16..31]], valid: position < seq_len and block live
    """

    blocks: torch.Tensor  # [S * W] block ids
    rows: int
    width: int
    valid: torch.Tensor  # [S, W * B] bool
    positions: torch.Tensor  # [S, W * B] logical position of each gathered key


def compact_gather(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> Gather:
    """The ``Gather`` of ``block_tables [S, max_blocks]`` with ``seq_lens [S]``."""
    num_table_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_table_blocks].long()
    live = table != NULL_BLOCK
    # Stable sort moves each row's live blocks to the front, in logical order.
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)
    width = max(int(live.sum(dim=1).max()), 1)
    order = order[:, :width]
    compact = table.gather(1, order)
    offsets = torch.arange(block_size, device=block_tables.device)
    positions = (order[:, :, None] * block_size + offsets).flatten(1)
    valid = (positions < seq_lens[:, None].long()) & (compact != NULL_BLOCK).repeat_interleave(block_size, dim=1)
    return Gather(compact.flatten(), compact.shape[0], width, valid, positions)


@dataclass(frozen=True)
class PrefillSeq:
    """One multi-token query segment: rows ``start:end`` of the packed queries, its gather and its causal mask."""

    start: int
    end: int
    gather: Gather
    mask: torch.Tensor  # [1, 1, n, L] bool


@dataclass(frozen=True)
class AttentionPlan:
    """Everything ``paged_attention`` derives from the step's metadata, built once per forward and
    shared by every layer (the metadata is the same in all of them): single-token queries batched into
    one group, each longer query segment on its own."""

    decode_tok: torch.Tensor | None  # [Sd] query rows of the single-token sequences (None: all rows, in order)
    decode: Gather | None
    decode_mask: torch.Tensor | None  # [Sd, 1, 1, L]
    prefill: tuple[PrefillSeq, ...]


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, window: int | None = None) -> AttentionPlan:
    """The ``AttentionPlan`` of one forward's paged metadata, for layers with sliding ``window`` (None: full)."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    q_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    if window is not None:
        block_tables = window_tables(block_tables, seq_lens, query_start_loc[1:] - query_start_loc[:-1], block_size, window)
    decode = [i for i in range(num_seqs) if q_lens[i] == 1]
    dev = block_tables.device
    decode_tok = dg = decode_mask = None
    if decode:
        if len(decode) == num_seqs:  # a decode-only step: the queries are the rows, in order
            d_lens = seq_lens
            dg = compact_gather(block_tables, seq_lens, block_size)
        else:
            idx = torch.tensor(decode, dtype=torch.long, device=dev)
            d_lens = seq_lens[idx]
            dg = compact_gather(block_tables[idx], d_lens, block_size)
            decode_tok = query_start_loc[idx].long()
        valid = dg.valid
        if window is not None:
            valid = valid & (dg.positions > d_lens.long()[:, None] - 1 - window)
        decode_mask = valid[:, None, None, :]
    prefill = []
    for i in range(num_seqs):
        n = q_lens[i]
        if n <= 1:
            continue
        g = compact_gather(block_tables[i : i + 1], seq_lens[i : i + 1], block_size)
        q_pos = torch.arange(lens[i] - n, lens[i], device=dev)
        mask = g.valid[:, None, :] & (g.positions[:, None, :] <= q_pos[None, :, None])
        if window is not None:
            mask = mask & (g.positions[:, None, :] > q_pos[None, :, None] - window)
        prefill.append(PrefillSeq(starts[i], starts[i + 1], g, mask[:, None, :, :]))
    return AttentionPlan(decode_tok, dg, decode_mask, tuple(prefill))


def _gather_fp(k_cache: torch.Tensor, v_cache: torch.Tensor, g: Gather) -> tuple[torch.Tensor, torch.Tensor]:
    # index_select on a [num_blocks, block_size * Hkv * D] view: ~2x faster than advanced indexing on CPU.
    shape = (g.rows, g.width * k_cache.shape[1], *k_cache.shape[2:])
    keys = k_cache.flatten(1).index_select(0, g.blocks).view(shape)
    values = v_cache.flatten(1).index_select(0, g.blocks).view(shape)
    return keys, values


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
    g = compact_gather(block_tables, seq_lens, k_cache.shape[1])
    return (*_gather_fp(k_cache, v_cache, g), g.valid, g.positions)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, Hq, D]`` over paged caches; returns ``[T, Hq, D]``.

    Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``window``: sliding-window
    layer (see the module docstring); ``sinks [Hq]``: learned sink logits. ``plan``: the step's
    ``plan_attention`` for this ``window`` (built here when not given).
    """
    plan = plan or plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1], window)
    return _paged_attention(query, lambda g: _gather_fp(k_cache, v_cache, g), plan, scale, sinks)


def window_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor, block_size: int,
                  window: int) -> torch.Tensor:
    """``block_tables`` with every block that lies wholly before the window of a sequence's *first* query
    replaced by the null block, so a sliding-window layer gathers ``O(window)`` keys, not the whole history::

        block_size 4, window 6, seq_len 14, one new query (position 13, sees 8..13)
        table [ 5 | 9 | 2 | 7 ]  ->  [ 0 | 0 | 2 | 7 ]     (blocks 0-1 hold 0..7: out of the window)

    Blocks holding part of the window stay; the exact position mask removes the rest.
    """
    first_q = seq_lens.long() - q_lens.long()
    first_block = torch.clamp(first_q - window + 1, min=0) // block_size  # [S]
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    return torch.where(cols[None, :] < first_block[:, None], torch.zeros_like(block_tables), block_tables)


def _paged_attention(query: torch.Tensor, fetch, plan: AttentionPlan, scale: float,
                     sinks: torch.Tensor | None = None, decode=None) -> torch.Tensor:
    """``paged_attention`` with the KV fetch ``fetch(gather) -> keys, values [S, L, Hkv, D]``. ``decode``:
    the single-token group's attention ``decode(query, gather, mask) -> [S, Hq, D]`` (None: fetch and
    ``_decode_attention``)."""
    if decode is None:
        def decode(q: torch.Tensor, g: Gather, mask: torch.Tensor) -> torch.Tensor:
            return _decode_attention(q, *fetch(g), mask, scale, sinks)
    if plan.decode is not None and plan.decode_tok is None:
        return decode(query, plan.decode, plan.decode_mask)  # a decode-only step: the queries are the rows
    out = torch.empty_like(query)
    if plan.decode is not None:
        tok = plan.decode_tok
        out[tok] = decode(query[tok], plan.decode, plan.decode_mask)
    for seg in plan.prefill:
        keys, values = fetch(seg.gather)
        q = query[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k, v = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        o = _attend(q, k, v, seg.mask, scale, None if sinks is None else sinks.view(1, -1, 1, 1))
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out


def _decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: ``query [S, Hq, D]`` over ``keys/values [S, L, Hkv, D]`` -> ``[S, Hq, D]``.

    Single-token queries batch into one call: padding only along the key axis, and every valid key
    precedes the query, so no causal mask is needed. Each KV head's query heads fold into the query-row
    axis ``[S, Hkv, Hq/Hkv, D]``: exact with one query token, and SDPA then reads K/V once per KV head
    instead of expanding them Hq/Hkv times (enable_gqa) from a strided transpose.
    """
    q = query.unflatten(1, (keys.shape[2], -1))
    k = keys.transpose(1, 2).to(q.dtype)
    v = values.transpose(1, 2).to(q.dtype)
    row_sinks = None if sinks is None else sinks.view(1, keys.shape[2], -1, 1)  # [1, Hkv, G, 1]
    return _attend(q, k, v, mask, scale, row_sinks).flatten(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """``q [B, H, n, D]`` against ``k, v [B, Hk, L, D]`` (``H`` a multiple of ``Hk``) with a boolean ``mask``
    broadcastable to the scores. ``sinks`` (broadcastable to ``[B, H, n, 1]``): learned sink logits, an
    extra softmax column whose probability is dropped (transformers' gpt-oss eager attention)."""
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                enable_gqa=k.shape[1] != q.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    s = torch.cat([s, sinks.float().expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    return (p @ v.float()).to(q.dtype)


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


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., D]`` codes in 0..15 into ``[..., D/2]`` bytes: low nibble channel c, high nibble c + D/2."""
    half = codes.shape[-1] // 2
    c = codes.to(torch.uint8)
    return c[..., :half] | (c[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[..., D/2]`` bytes -> ``[..., D]`` codes (uint8)."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` -> bytes ``[..., D * bits / 8]``. int4 as ``pack_int4``; int2 packs the four
    quarters of the channels into one byte, the same split-the-head idea without an interleave::

        byte c (c < D/4) = code[c] | code[c + D/4] << 2 | code[c + D/2] << 4 | code[c + 3D/4] << 6

    >>> pack_codes(torch.tensor([[1, 2, 3, 0, 3, 3, 1, 2]]), 2).tolist()    # D = 8
    [[125, 178]]
    """
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        return pack_int4(codes)
    q = codes.shape[-1] // 4
    c = codes.to(torch.uint8)
    return c[..., :q] | (c[..., q : 2 * q] << 2) | (c[..., 2 * q : 3 * q] << 4) | (c[..., 3 * q :] << 6)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``."""
    if bits == 8:
        return packed
    if bits == 4:
        return unpack_int4(packed)
    return torch.cat([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6], dim=-1)


def _quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``[n, B, H, D]``: one (scale, zero) per channel over the block's tokens (fp16-rounded first)."""
    qmax = (1 << bits) - 1
    k = k.float()
    kz = k.amin(1).half().float()
    ks = ((k.amax(1) - kz) / qmax).half().float()
    kc = ((k - kz[:, None]) / torch.where(ks > 0, ks, 1.0)[:, None] + 0.5).floor().clamp(0, qmax)
    return kc, ks, kz


def _quantize_values(v: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[n, B, H, D]``: one (scale, zero) per token per ``group_size`` channels."""
    qmax = (1 << bits) - 1
    v = v.float().unflatten(-1, (-1, group_size))
    vz = v.amin(-1).half().float()
    vs = ((v.amax(-1) - vz) / qmax).half().float()
    vc = ((v - vz[..., None]) / torch.where(vs > 0, vs, 1.0)[..., None] + 0.5).floor().clamp(0, qmax).flatten(-2)
    return vc, vs, vz


def quantize_blocks(
    k_blocks: torch.Tensor, v_blocks: torch.Tensor, bits: int, group_size: int
) -> tuple[torch.Tensor, ...]:
    """Asymmetric quantization of whole blocks ``[n, B, H, D]`` (layout of ``sinkserve_kernels.kv_quant``).

    Keys: one (scale, zero) per channel over the block's tokens -> ``[n, H, D]``. Values: one per token per
    ``group_size`` channels -> ``[n, B, H, D / G]``. Scales/zeros are rounded to fp16 first and the codes
    computed against the rounded values. Returns unpacked codes ``(kc, ks, kz, vc, vs, vz)`` (codes as float).
    """
    return (*_quantize_keys(k_blocks, bits), *_quantize_values(v_blocks, bits, group_size))


def _store_keys(cache, block_ids: torch.Tensor, k: torch.Tensor) -> None:
    kc, ks, kz = _quantize_keys(k, cache.bits)
    cache.k_codes[block_ids] = pack_codes(kc, cache.bits)
    cache.k_scale[block_ids] = ks.half()
    cache.k_zero[block_ids] = kz.half()
    if cache.outlier_idx is not None:
        # Dense-and-sparse: the outlier channels' 16-bit values replace their codes on dequantization.
        idx = cache.outlier_idx.expand(k.shape[0], k.shape[1], -1, -1)
        cache.k_outlier[block_ids] = k.gather(-1, idx).to(cache.k_outlier.dtype)


def quantize_into(cache, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Pack 16-bit blocks ``k, v [n, B, H, D]`` into ``cache`` (a ``kv_quant.QuantKVCache``) at
    ``block_ids`` and mark them quantized (``fp_index = -1``)."""
    block_ids = block_ids.long()
    _store_keys(cache, block_ids, k)
    vc, vs, vz = _quantize_values(v, cache.bits, cache.group_size)
    cache.v_codes[block_ids] = pack_codes(vc, cache.bits)
    cache.v_scale[block_ids] = vs.half()
    cache.v_zero[block_ids] = vz.half()
    cache.fp_index[block_ids] = -1


def quantize_fp_slots(cache, block_ids: torch.Tensor, fp_slots: torch.Tensor) -> None:
    """Pack the 16-bit pool's blocks ``fp_slots`` into ``block_ids`` (a block leaving the high-precision
    set); the caller reuses the slots. Slots are explicit because ``fp_index`` may be shared by layers."""
    slots = fp_slots.long()
    quantize_into(cache, block_ids, cache.fp_k[slots], cache.fp_v[slots])


def dequantize_blocks(cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(k, v) [n, B, H, D]`` of ``block_ids``: 16-bit-resident blocks from the 16-bit pool, the
    others ``code * scale + zero`` (outlier channels from their 16-bit copies)."""
    ids = block_ids.long()
    bits, g = cache.bits, cache.group_size
    k = unpack_codes(cache.k_codes[ids], bits).float() * cache.k_scale[ids].float()[:, None] + cache.k_zero[ids].float()[:, None]
    if cache.outlier_idx is not None:
        idx = cache.outlier_idx.expand(k.shape[0], k.shape[1], -1, -1)
        k.scatter_(-1, idx, cache.k_outlier[ids].float())
    vs = cache.v_scale[ids].float().repeat_interleave(g, dim=-1)
    vz = cache.v_zero[ids].float().repeat_interleave(g, dim=-1)
    v = unpack_codes(cache.v_codes[ids], bits).float() * vs + vz
    fp = cache.fp_index[ids].long()
    is_fp = fp >= 0
    if bool(is_fp.any()):
        k[is_fp] = cache.fp_k[fp[is_fp]].float()
        v[is_fp] = cache.fp_v[fp[is_fp]].float()
    return k, v


def dequantize_cache(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Full fp32 ``(k_cache, v_cache) [NB, B, H, D]`` of a ``kv_quant.QuantKVCache``: 16-bit-resident blocks
    (``fp_index >= 0``) come from the 16-bit pool, the others are dequantized ``code * scale + zero``."""
    return dequantize_blocks(cache, torch.arange(cache.num_blocks, device=cache.k_codes.device))


def requantize_keys(cache, block_ids: torch.Tensor, k: torch.Tensor) -> None:
    """Replace the keys of packed blocks (e.g. after a RoPE rotation); values are left as they are."""
    _store_keys(cache, block_ids.long(), k)


def write_kv_quant(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor) -> None:
    """``write_kv`` into a quantized cache: new tokens land in their blocks' 16-bit pool slots (tokens of a
    packed block, or slot < 0, are skipped: packed blocks are immutable)."""
    b = cache.block_size
    slots = slot_mapping.long()
    blk = torch.where(slots >= 0, slots // b, 0)
    fp = cache.fp_index[blk].long()
    fp_slots = torch.where((slots >= 0) & (fp >= 0), fp * b + slots % b, -1)
    write_kv(key, value, cache.fp_k, cache.fp_v, fp_slots)


def _gather_quant(cache, g: Gather, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    b = cache.block_size
    flat = g.blocks
    shape = (flat.numel(), b, cache.num_kv_heads, cache.head_dim)
    keys = torch.empty(shape, dtype=dtype, device=flat.device)
    values = torch.empty(shape, dtype=dtype, device=flat.device)
    dequantize_packed_into(cache, flat, keys, values)
    slot = cache.fp_index.index_select(0, flat).long()
    rows = (slot >= 0).nonzero().flatten()
    if rows.numel():
        keys.index_copy_(0, rows, cache.fp_k.index_select(0, slot[rows]).to(dtype))
        values.index_copy_(0, rows, cache.fp_v.index_select(0, slot[rows]).to(dtype))
    return keys.view(g.rows, g.width * b, *shape[2:]), values.view(g.rows, g.width * b, *shape[2:])


def gather_kv_quant(cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gather_kv`` over a quantized cache, dequantizing as it gathers: every gathered block is decoded
    from its codes straight into the gathered tensor (one float pass), then the 16-bit blocks' rows are
    overwritten from the side pool (a pass over those rows only)."""
    g = compact_gather(block_tables, seq_lens, cache.block_size)
    return (*_gather_quant(cache, g, dtype), g.valid, g.positions)


def paged_attention_quant(
    query: torch.Tensor,
    cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """``paged_attention`` over a quantized cache (a ``kv_quant.QuantKVCache``); null blocks are skipped
    as everywhere. Single-token queries gather each sequence's blocks split by precision once per step
    (``packed_decode``): a layer dequantizes only the packed blocks and copies the 16-bit ones, then runs
    SDPA. Multi-token segments (prefill chunks) dequantize on gather (``gather_kv_quant``). Equal to
    ``paged_attention`` on ``dequantize_cache(cache)`` within float rounding."""
    plan = plan or plan_attention(block_tables, seq_lens, query_start_loc, cache.block_size, window)

    def decode(q: torch.Tensor, g: Gather, mask: torch.Tensor) -> torch.Tensor:
        sg = packed_decode.split_gather(plan, g, mask, cache)
        return _decode_attention(q, *packed_decode.decode_keys_values(cache, sg, q.dtype), sg.mask, scale, sinks)

    return _paged_attention(query, lambda g: _gather_quant(cache, g, query.dtype), plan, scale, sinks, decode=decode)


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
