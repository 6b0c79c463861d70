"""Sparse attention over top-k slots (16-bit and quantized KV) against the torch reference, and the
indexer -> top-k -> sparse pipeline against dense paged attention when k covers every position."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import torch_kernels
from sinkserve_kernels.indexer import indexer_topk
from sinkserve_kernels.kv_quant import QuantKVCache, quantize_write_kv
from sinkserve_kernels.paged_attention import paged_attention
from sinkserve_kernels.sparse_attention import sparse_attention, sparse_attention_quant
from tests.kernels.kernel_cases import check, make_batch, poisoned_like

BS = 16


def _slots(b, k: int, seed: int) -> torch.Tensor:
    """Top-k selection from random scores (with sinks and a window) for a batch, then one row blanked."""
    g = torch.Generator().manual_seed(seed)
    n = b.block_tables.shape[1] * BS
    scores = torch.randn(b.query.shape[0], n, generator=g).to(b.query.device)
    slots = torch_kernels.topk_select(scores, k, b.block_tables, b.seq_lens, b.query_start_loc, BS, window=4)
    return slots


# (Hq, Hkv, D, dtype): GQA ratios 1, 4, 8; head dims 64, 128; fp32 and bf16
SHAPES = [(2, 2, 128, torch.float32), (4, 1, 64, torch.bfloat16), (8, 1, 64, torch.float32), (8, 2, 128, torch.bfloat16)]


@pytest.mark.parametrize("hq,hkv,d,dtype", SHAPES, ids=["gqa1_d128_fp32", "gqa4_d64_bf16", "gqa8_d64_fp32", "gqa4_d128_bf16"])
def test_sparse_attention_matches_reference(hq: int, hkv: int, d: int, dtype: torch.dtype, device) -> None:
    # k = 24: short rows select everything (-1 padded), long rows select a true subset.
    b = make_batch([1, 5, 1], [1, 40, 70], hq, hkv, d, BS, dtype, device=device, seed=hq * d)
    slots = _slots(b, 24, seed=d)
    slots[1] = -1  # a row with nothing selected returns zeros
    out = sparse_attention(b.query, b.k_cache, b.v_cache, slots, d**-0.5, out=poisoned_like(b.query))
    f32 = [t.float() for t in (b.query, b.k_cache, b.v_cache)]
    ref = torch_kernels.sparse_attention(f32[0], f32[1], f32[2], slots, d**-0.5)
    check("sparse_attention", out.float(), ref, dtype)
    assert torch.equal(out[1].float(), torch.zeros_like(ref[1]))


def test_sparse_split_matches_reference(device: torch.device) -> None:
    b = make_batch([1, 1], [70, 33], 4, 1, 64, BS, device=device, seed=9)
    slots = _slots(b, 40, seed=9)
    out = sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.125, num_splits=3, out=poisoned_like(b.query))
    check("sparse_attention_split", out, torch_kernels.sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.125),
          torch.float32)  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_sparse_attention_quant_matches_reference(bits: int, device: torch.device) -> None:
    hkv, d = 2, 64
    b = make_batch([1, 4], [60, 50], 8, hkv, d, BS, device=device, seed=bits)
    num_blocks = b.k_cache.shape[0]
    cache = QuantKVCache.allocate(num_blocks, 2, BS, hkv, d, bits=bits, group_size=32, dtype=torch.float32,
                                  device=device)  # fmt: skip
    ids = torch.arange(num_blocks, device=device)
    quantize_write_kv(b.k_cache.reshape(-1, hkv, d), b.v_cache.reshape(-1, hkv, d), cache, ids, ids * BS)
    sink = int(b.block_tables[0, 0])
    cache.fp_index[sink] = 0  # the sink block of sequence 0 stays 16-bit
    cache.fp_k[0], cache.fp_v[0] = b.k_cache[sink], b.v_cache[sink]
    slots = _slots(b, 20, seed=bits)
    out = sparse_attention_quant(b.query, cache, slots, d**-0.5, out=poisoned_like(b.query))
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    check(f"sparse_attention_int{bits}", out, torch_kernels.sparse_attention(b.query, k_deq, v_deq, slots, d**-0.5),
          torch.float32)  # fmt: skip


def test_pipeline_with_k_covering_everything_equals_dense(device: torch.device) -> None:
    """indexer -> top-k -> sparse == dense paged attention when every visible position is selected
    (short sequences fall back to dense)."""
    b = make_batch([1, 6, 1], [17, 30, 48], 4, 1, 64, BS, device=device, seed=13)
    g = torch.Generator().manual_seed(13)
    num_blocks = b.k_cache.shape[0]
    q_idx = torch.randn(b.query.shape[0], 4, 32, generator=g).to(device)
    w = torch.randn(b.query.shape[0], 4, generator=g).to(device)
    idx_keys = torch.randn(num_blocks, BS, 32, generator=g).to(device)
    slots = indexer_topk(q_idx, w, idx_keys, b.block_tables, b.seq_lens, b.query_start_loc, 64, window=4)
    sparse = sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.125)
    dense = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    check("sparse_vs_dense_full_k", sparse, dense, torch.float32)
