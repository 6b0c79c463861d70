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

NULL_BLOCK = 0


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather each sequence's cached keys/values into ``[S, L, Hkv, D]`` with a ``[S, L]`` validity mask.

    ``L`` covers the longest sequence rounded up to whole blocks; positions past ``seq_lens[s]`` and
    positions in null blocks are invalid.
    """
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    num_table_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_table_blocks].long()
    keys = k_cache[table].flatten(1, 2)
    values = v_cache[table].flatten(1, 2)
    positions = torch.arange(num_table_blocks * block_size, device=k_cache.device)
    valid = (positions[None, :] < seq_lens[:, None].long()) & (table != NULL_BLOCK).repeat_interleave(
        block_size, dim=1
    )
    return keys, values, valid


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
        # Single-token queries batch into one call: padding only along the key axis.
        idx = torch.tensor(decode, dtype=torch.long, device=query.device)
        keys, values, valid = gather_kv(k_cache, v_cache, block_tables[idx], seq_lens[idx])
        tok = query_start_loc[idx].long()
        q = query[tok].unsqueeze(2)  # [B, Hq, 1, D]
        o = _sdpa(q, keys, values, valid[:, None, None, :], scale)
        out[tok] = o.squeeze(2)
    for i in range(num_seqs):
        n = q_lens[i]
        if n <= 1:
            continue
        keys, values, valid = gather_kv(k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1])
        q_pos = torch.arange(lens[i] - n, lens[i], device=query.device)
        k_pos = torch.arange(keys.shape[1], device=query.device)
        mask = valid[:, None, :] & (k_pos[None, None, :] <= q_pos[None, :, None])
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
