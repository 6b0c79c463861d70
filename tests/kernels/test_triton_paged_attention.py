"""Triton paged attention and write_kv against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.attention_backends import get_backend
from kernels import reference
from kernels.paged_attention import paged_attention, write_kv
from tests.kernels.kernel_cases import check, make_batch, poisoned_like

# name: (q_lens, seq_lens, Hq, Hkv, D, block_size)
CASES = {
    # decode only: lengths 1, at a block boundary (16), across it (17), long with a null block
    "decode_gqa4_d64": ([1, 1, 1, 1], [1, 16, 17, 50], 4, 1, 64, 16),
    # prefill chunks and decode tokens together; block_size 8 so chunks cross several blocks
    "mixed_gqa1_d128": ([5, 1, 16, 1], [37, 16, 33, 70], 2, 2, 128, 8),
    # whole-prompt prefill (causal inside the chunk) and a chunk continuing a cached prefix
    "prefill_gqa8_d64": ([20, 3], [20, 35], 8, 1, 64, 16),
}


def _run(name: str, dtype: torch.dtype, device: torch.device, num_splits: int | None = None) -> None:
    q_lens, seq_lens, hq, hkv, d, bs = CASES[name]
    b = make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, device=device, seed=zlib.crc32(name.encode()) % 1000)
    scale = d**-0.5
    out = poisoned_like(b.query)
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                          num_splits=num_splits, out=out)  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    f32 = [t.float() for t in (b.query, b.k_cache, b.v_cache)]
    ref = reference.paged_attention(f32[0], f32[1], f32[2], b.block_tables, b.seq_lens, b.query_start_loc, scale)
    kernel = "paged_attention" if num_splits is None else "paged_attention_split"
    check(kernel, got.float(), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference(name: str, dtype: torch.dtype, device: torch.device) -> None:
    _run(name, dtype, device)


@pytest.mark.parametrize("name", ["decode_gqa4_d64", "mixed_gqa1_d128"])
def test_split_kv_matches_reference(name: str, device: torch.device) -> None:
    # 3 segments: some sequences are shorter than a segment, so empty segments must merge as weight 0.
    _run(name, torch.float32, device, num_splits=3)


def test_non_power_of_two_gqa_ratio(device: torch.device) -> None:
    b = make_batch([1, 4], [9, 4], 3, 1, 64, 16, torch.float32, device=device, seed=3)
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125,
                          out=poisoned_like(b.query))  # fmt: skip
    ref = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    check("paged_attention", got, ref, torch.float32)


def test_fully_evicted_history_gives_zeros_not_nan(device: torch.device) -> None:
    # A decode token whose every visible block is null (all evicted) has nothing to attend to.
    b = make_batch([1], [20], 2, 1, 64, 16, torch.float32, device=device, seed=4, null_blocks=False)
    b.block_tables[0, :] = 0
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125,
                          out=poisoned_like(b.query))  # fmt: skip
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_reference(cache_dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(5)
    num_blocks, bs, hkv, d, t = 6, 16, 2, 64, 21
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(cache_dtype).to(device)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(cache_dtype).to(device)
    # Keys as the engine passes them: a transposed (non-contiguous) view of [Hkv, T, D].
    key = torch.randn(hkv, t, d, generator=g).to(device).transpose(0, 1)
    value = torch.randn(hkv, t, d, generator=g).to(device).transpose(0, 1)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t].to(torch.int64)
    slots[[0, 7]] = -1  # tokens whose KV must not be stored
    slots = slots.to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, want_k, want_v, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_registry_resolves_triton_backend() -> None:
    backend = get_backend("triton")
    assert backend.name == "triton"
    assert backend.paged_attention is paged_attention and backend.write_kv is write_kv


def test_head_dim_not_power_of_two(device: torch.device) -> None:
    # D = 96 (e.g. Phi-style heads): half tiles of 48 channels padded to 64 and masked.
    b = make_batch([1, 3], [30, 20], 4, 2, 96, 16, torch.float32, device=device, seed=6)
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.1,
                          out=poisoned_like(b.query))  # fmt: skip
    ref = reference.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.1)
    check("paged_attention", got, ref, torch.float32)
