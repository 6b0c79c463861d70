"""The ``cpu`` backend's packed-KV decode (``sinkserve_kernels/csrc/decode_attention.c``'s core) against the torch
reference ``sinkserve_kernels.torch_kernels.paged_attention_quant``, on caches in the exact layout of ``sinkserve_kernels/kv_quant.py``:
int8 / int4 / int2 codes, per-channel key and per-token value scales, outlier key channels, and sequences
that mix 16-bit side-pool blocks with packed ones."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
import torch

from sinkserve_kernels import cpu_attention, torch_kernels
from sinkserve_kernels.cpu_lib import load_source
from sinkserve_kernels.kv_quant import QuantKVCache
from tests.kernels.kernel_cases import check, make_batch, rel_err

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler: the cpu backend is the reference")


def _used_blocks(b) -> list[list[int]]:
    bs = b.block_size
    return [[blk for blk in row[: -(-n // bs)] if blk] for row, n in zip(b.block_tables.tolist(), b.seq_lens.tolist())]


def _cache(b, bits: int, outliers: int, fp_blocks: list[int], group: int = 8, dtype=torch.float32) -> QuantKVCache:
    """Every block packed from the batch's K/V, then ``fp_blocks`` moved to the 16-bit pool (as sinks and the
    residual window are); outlier channels spread over the head."""
    nb, bs, h, d = b.k_cache.shape
    cache = QuantKVCache.allocate(nb, len(fp_blocks) + 1, bs, h, d, bits=bits, group_size=group, dtype=dtype,
                                  outlier_channels=outliers)
    if outliers:
        per_head = [torch.randperm(d, generator=torch.Generator().manual_seed(hh))[:outliers].sort().values
                    for hh in range(h)]
        cache.outlier_idx = torch.stack(per_head)[None]
    torch_kernels.quantize_into(cache, torch.arange(nb), b.k_cache, b.v_cache)
    for slot, block in enumerate(fp_blocks):
        cache.fp_index[block] = slot
        cache.fp_k[slot] = b.k_cache[block].to(dtype)
        cache.fp_v[slot] = b.v_cache[block].to(dtype)
    return cache


def _mixed(b, bits: int, outliers: int, **kw) -> QuantKVCache:
    # Row 0 all 16-bit, row 1 all packed, the rest mixed: first and last block 16-bit (sinks, residual window).
    used = _used_blocks(b)
    fp = sorted(set(used[0]) | {r[0] for r in used[2:]} | {r[-1] for r in used[2:]})
    return _cache(b, bits, outliers, fp, **kw)


def _both(b, cache, window=None, sinks=None, plan=None):
    args = (b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc, b.query.shape[-1] ** -0.5)
    ref = torch_kernels.paged_attention_quant(*args, window=window, sinks=sinks)
    out = cpu_attention.paged_attention_quant(*args, window=window, sinks=sinks, plan=plan)
    return out, ref


@pytest.mark.parametrize("bits,outliers", [(8, 0), (4, 0), (4, 3), (2, 0), (2, 4)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("window_sinks", [False, True], ids=["full", "window_sinks"])
def test_decode_matches_reference(bits, outliers, heads, window_sinks):
    """One token per sequence; null blocks; 16-bit, packed and mixed rows; GQA 1 / 2 / 4."""
    hq, hkv = heads
    b = make_batch([1] * 5, [9, 70, 45, 60, 130], hq, hkv, 32, block_size=16, seed=bits * 7 + outliers + hq)
    cache = _mixed(b, bits, outliers)
    kw = dict(window=20, sinks=torch.linspace(-2.0, 3.0, hq)) if window_sinks else {}
    out, ref = _both(b, cache, **kw)
    check(f"cpu decode_attention_quant int{bits}", out, ref, torch.float32)


@pytest.mark.parametrize("head_dim,block_size", [(4, 256), (8, 16), (16, 8), (64, 16), (128, 64), (256, 32)])
def test_head_dims_and_chunks_within_a_block(head_dim, block_size):
    """Every specialised copy (D 32 above, 64, 128) and the generic one (4, 8, 16, 256); at D=128 a 64-token
    block is decoded in 16-token chunks, so the online softmax rescales within one block; at D=4 a 256-token
    block in chunks of MAX_CHUNK (128) tokens, not the tile's 512. D 4 and 8 are the smallest heads the
    packings admit (int4 pairs channel c with c + D/2) and ran on the torch reference before."""
    assert cpu_attention.quant_kernel_ok(torch.float32, QuantKVCache.allocate(2, 1, block_size, 2, head_dim, bits=4,
                                                                               group_size=min(8, head_dim // 2),
                                                                               dtype=torch.float32))
    b = make_batch([1] * 4, [5, 3 * block_size + 1, 200, 97], 8, 2, head_dim, block_size=block_size, seed=head_dim)
    cache = _mixed(b, 4, min(2, head_dim // 4), group=min(8, head_dim // 2))
    out, ref = _both(b, cache, sinks=torch.randn(8))
    check("cpu decode_attention_quant dims", out, ref, torch.float32)


def test_outlier_channels_are_read():
    """int2 with outliers planted in the kept channels: the kernel must read their 16-bit copies (the same
    codes without them give a clearly different answer)."""
    b = make_batch([1] * 3, [40, 90, 64], 4, 2, 32, block_size=16, seed=11)
    b.k_cache[..., [3, 20]] *= 25.0
    cache = _cache(b, 2, 2, [])
    cache.outlier_idx = torch.tensor([[[3, 20], [3, 20]]])
    torch_kernels.quantize_into(cache, torch.arange(cache.num_blocks), b.k_cache, b.v_cache)
    out, ref = _both(b, cache)
    check("cpu decode_attention_quant outliers", out, ref, torch.float32)
    cache.outlier_idx, cache.k_outlier = None, None
    without, _ = _both(b, cache)
    assert rel_err(without, out) > 100 * rel_err(out, ref)


def test_mixed_step_empty_window_and_strided_query():
    """Prefill chunks beside decodes (the reference fills their rows), a strided query, and a decode whose
    window holds only an evicted block (zeros, with sinks too)."""
    b = make_batch([1, 7, 1, 20, 1], [33, 7, 90, 52, 40], 4, 2, 32, block_size=8, seed=5)
    b.block_tables[4, 4] = 0  # seq 4's last block (positions 32..39) evicted: window 3 sees nothing
    qk = torch.cat([b.query, torch.randn(b.query.shape[0], 2, 32)], dim=1)
    b.query = qk[:, :4]
    cache = _mixed(b, 4, 2)
    plan = cpu_attention.plan(b.block_tables, b.seq_lens, b.query_start_loc, 8, 3)
    assert not plan.decode_only
    out, ref = _both(b, cache, window=3, sinks=torch.randn(4), plan=plan)
    assert torch.equal(out[b.query_start_loc[4]], torch.zeros(4, 32))
    check("cpu decode_attention_quant mixed", out, ref, torch.float32)


def test_decode_does_not_take_the_reference_path(monkeypatch):
    """One path per feature: a decode-only step over a float32 packed cache never calls the torch decode."""
    b = make_batch([1] * 3, [20, 64, 50], 4, 2, 32, block_size=16, seed=2)
    cache = _mixed(b, 4, 0)
    want = torch_kernels.paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc, 32 ** -0.5)

    def refuse(*args, **kwargs):
        raise AssertionError("torch packed decode called")

    monkeypatch.setattr(torch_kernels, "paged_attention_quant", refuse)
    monkeypatch.setattr(torch_kernels, "_gather_quant", refuse)
    out = cpu_attention.paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                              32 ** -0.5)
    check("cpu decode_attention_quant", out, want, torch.float32)


def test_bfloat16_side_pool_falls_back_to_reference():
    b = make_batch([1, 1], [20, 35], 4, 2, 32, block_size=16, seed=4)
    cache = _mixed(b, 4, 0, dtype=torch.bfloat16)
    b.query = b.query.bfloat16()
    out, ref = _both(b, cache)
    assert torch.equal(out, ref)


# --- one core: the portable build (-mno-avx512f), and float32 blocks read by the packed cache's path ---------

SOURCE = Path(cpu_attention.__file__).parent / "csrc" / "decode_attention.c"


@functools.cache
def _portable():
    return load_source(SOURCE.read_text(), ("-I", str(SOURCE.parent), "-mno-avx512f"))


def _quant_call(lib, b, cache, window=None, sinks=None) -> torch.Tensor:
    _, hq, d = b.query.shape
    tables, lens, starts = (t.to(torch.int32).contiguous() for t in (b.block_tables, b.seq_lens, b.query_start_loc))
    kv = cpu_attention.quant_cache_args(cache)
    out = torch.full(b.query.shape, float("nan"))
    sinks = sinks.contiguous() if sinks is not None else None
    rc = lib.sinkserve_decode_attention_quant(
        b.query.data_ptr(), b.query.stride(0), b.query.stride(1), ctypes.byref(kv), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), starts.data_ptr(), lens.shape[0], hq, cache.num_kv_heads, d,
        cache.block_size, d ** -0.5, window or 0, sinks.data_ptr() if sinks is not None else None, out.data_ptr())
    assert rc == 0
    return out


@pytest.mark.parametrize("bits,outliers", [(8, 0), (4, 3), (2, 4)])
def test_portable_build_matches_reference(bits, outliers):
    """The packed cache through the core built without AVX-512 (what a CPU without it runs)."""
    b = make_batch([1] * 4, [9, 70, 45, 130], 8, 2, 64, block_size=16, seed=bits + outliers)
    cache = _mixed(b, bits, outliers)
    sinks = torch.linspace(-2.0, 3.0, 8)
    ref = torch_kernels.paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                              64 ** -0.5, window=20, sinks=sinks)
    check(f"portable decode_attention_quant int{bits}", _quant_call(_portable(), b, cache, 20, sinks), ref,
          torch.float32)


@pytest.mark.parametrize("head_dim", [32, 48, 64])
def test_float32_cache_and_sixteen_bit_blocks_share_one_loop(head_dim):
    """One core reads a float32 cache and a packed cache's 16-bit blocks: with every block in the side pool
    the packed entry gives bit for bit what the float32 entry gives (portable build: no AVX-512 path)."""
    b = make_batch([1] * 3, [7, 50, 129], 8, 2, head_dim, block_size=16, seed=head_dim)
    cache = _cache(b, 4, 0, sorted({blk for row in _used_blocks(b) for blk in row}))
    sinks = torch.randn(8)
    tables, lens, starts = (t.to(torch.int32).contiguous() for t in (b.block_tables, b.seq_lens, b.query_start_loc))
    fp = torch.full(b.query.shape, float("nan"))
    rc = _portable().sinkserve_decode_attention(
        b.query.data_ptr(), b.query.stride(0), b.query.stride(1), b.k_cache.data_ptr(), b.v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(), lens.shape[0], 8, 2, head_dim, 16,
        head_dim ** -0.5, 0, sinks.data_ptr(), fp.data_ptr())
    assert rc == 0
    assert torch.equal(_quant_call(_portable(), b, cache, sinks=sinks), fp)
