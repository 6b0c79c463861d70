"""Triton paged attention and write_kv against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import zlib

import pytest
import torch

from sinkserve_kernels.backend import get_backend
from sinkserve_kernels import torch_kernels
from sinkserve_kernels.paged_attention import paged_attention, write_kv
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
    ref = torch_kernels.paged_attention(f32[0], f32[1], f32[2], b.block_tables, b.seq_lens, b.query_start_loc, scale)
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
    ref = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
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
    torch_kernels.write_kv(key, value, want_k, want_v, slots)
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
    ref = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.1)
    check("paged_attention", got, ref, torch.float32)


def _dense(b, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention written out per query token and head from the block tables (independent of the kernels)."""
    out = torch.zeros_like(b.query, dtype=torch.float64)
    bs, hq = b.block_size, b.query.shape[1]
    group = hq // b.k_cache.shape[2]
    starts, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for s in range(len(lens)):
        for t in range(starts[s], starts[s + 1]):
            q_pos = lens[s] - (starts[s + 1] - t)
            keys = [p for p in range(q_pos + 1) if int(b.block_tables[s, p // bs]) != 0
                    and (window is None or p > q_pos - window)]
            for h in range(hq):
                if not keys:
                    continue
                k = torch.stack([b.k_cache[b.block_tables[s, p // bs], p % bs, h // group] for p in keys]).double()
                v = torch.stack([b.v_cache[b.block_tables[s, p // bs], p % bs, h // group] for p in keys]).double()
                logits = k @ b.query[t, h].double() * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].double().view(1)])
                p = torch.softmax(logits, 0)[: len(keys)]
                out[t, h] = p @ v
    return out.to(b.query.dtype)


# (q_lens, seq_lens, Hq, Hkv, D, block_size, window): decodes and chunks longer than the window, a chunk
# that starts inside the window, windows not a multiple of the block size, and null blocks (make_batch).
WINDOW_CASES = {
    "decode_w16": ([1, 1, 1], [5, 40, 70], 4, 2, 32, 8, 16),
    "mixed_w13": ([20, 1, 7], [20, 50, 45], 4, 1, 32, 8, 13),
    "prefill_w64": ([90], [200], 2, 2, 32, 16, 64),
}


@pytest.mark.parametrize("sinks", [False, True], ids=["window", "window+sinks"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["single", "split"])
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_sliding_window_and_sinks_match_reference(name: str, num_splits: int | None, sinks: bool,
                                                  device: torch.device) -> None:
    q_lens, seq_lens, hq, hkv, d, bs, window = WINDOW_CASES[name]
    b = make_batch(q_lens, seq_lens, hq, hkv, d, bs, torch.float32, device=device, seed=zlib.crc32(name.encode()) % 997)
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(1)).mul(3).to(device) if sinks else None
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, d**-0.5,
                          window=window, sinks=sink, num_splits=num_splits, out=poisoned_like(b.query))
    ref = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                    d**-0.5, window=window, sinks=sink)
    check("paged_attention_window" + ("_sinks" if sinks else ""), got, ref, torch.float32)
    # The reference against attention written out per token: the window and the sink term are what they say.
    torch.testing.assert_close(ref.cpu(), _dense(b, d**-0.5, window, sink).cpu(), atol=1e-5, rtol=1e-5)


def test_sinks_without_window_and_with_no_visible_key(device: torch.device) -> None:
    # Sinks on a full layer; and a query whose every block is null still outputs zeros (not the sink's NaN).
    b = make_batch([1, 6], [37, 20], 4, 2, 32, 16, torch.float32, device=device, seed=11)
    sink = torch.tensor([0.5, -2.0, 4.0, 0.0], device=device)
    got = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.2,
                          sinks=sink, out=poisoned_like(b.query))
    ref = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.2,
                                    sinks=sink)
    check("paged_attention_sinks", got, ref, torch.float32)
    torch.testing.assert_close(ref, _dense(b, 0.2, None, sink), atol=1e-5, rtol=1e-5)
    # A large sink takes weight from every key: the output shrinks towards zero.
    big = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.2,
                                    sinks=torch.full((4,), 30.0, device=device))
    assert big.abs().max() < 1e-6 < ref.abs().max()
    b.block_tables[0, :] = 0
    empty = paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.2,
                            sinks=sink, out=poisoned_like(b.query))
    assert torch.equal(empty[0], torch.zeros_like(empty[0]))
