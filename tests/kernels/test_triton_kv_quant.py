"""Quantized KV: quantize-on-write kernel vs the torch quantizer, in-kernel dequantizing attention vs the
reference on the dequantized cache, quantization error vs 16-bit, and the block memory arithmetic."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import torch_kernels
from sinkserve_kernels.kv_quant import (
    QuantKVCache,
    bytes_per_block,
    paged_attention_quant,
    quantize_fp_blocks,
    quantize_write_kv,
    write_kv_fp,
)
from sinkserve_kernels.paged_attention import paged_attention
from tests.kernels.kernel_cases import MAX_ERRORS, check, make_batch, poisoned_like, rel_err

# Relative attention-output error vs 16-bit KV on random Gaussian data, with the sink block and each
# sequence's last block (residual window) kept 16-bit as in serving ("protected"), and with every block
# quantized ("all"). int4 "all" cannot meet 6e-2 on i.i.d. Gaussian data with any 4-bit scalar code: the
# rate-distortion bound sigma * 2^-R is 6.25% per element at R = 4 bits, for keys and values each
# (measured ~6.3% from either alone, ~10% together), so it is held to 0.12 and reported as such.
QUANT_ERROR_LIMIT = {(8, "protected"): 1e-2, (8, "all"): 1e-2, (4, "protected"): 6e-2, (4, "all"): 0.12}


@pytest.mark.parametrize("bits", [8, 4])
def test_block_bytes_match_layout_arithmetic(bits: int) -> None:
    cache = QuantKVCache.allocate(5, 2, 16, 8, 128, bits=bits, group_size=32)
    assert cache.quantized_bytes_per_block() == bytes_per_block(16, 8, 128, bits, 32)
    # The worked example in the kv_quant docstring.
    assert bytes_per_block(16, 8, 128, bits, 32) == {8: 38912, 4: 22528}[bits]


def _quantized_batch(
    bits: int, dtype: torch.dtype, device: torch.device, protect: bool = True, hq: int = 8, hkv: int = 2, d: int = 128
):
    """A mixed batch over a quantized cache: every block quantized from the 16-bit data, then (``protect``)
    the sink block and the last block of each sequence (residual window) switched to the 16-bit pool."""
    b = make_batch([1, 1, 6], [1, 70, 60], hq, hkv, d, 16, dtype, device=device, seed=11 + bits)
    num_blocks = b.k_cache.shape[0]
    cache = QuantKVCache.allocate(num_blocks, 8, 16, hkv, d, bits=bits, group_size=32, dtype=dtype, device=device)
    ids = torch.arange(num_blocks, device=device)
    quantize_write_kv(b.k_cache.reshape(-1, hkv, d), b.v_cache.reshape(-1, hkv, d), cache, ids, ids * 16)
    fp_blocks = []
    for s, n in enumerate(b.seq_lens.tolist()):
        used = -(-n // 16)
        fp_blocks += [int(b.block_tables[s, 0]), int(b.block_tables[s, used - 1])]
    fp_blocks = sorted(set(fp_blocks) - {0}) if protect else []
    for i, blk in enumerate(fp_blocks):
        cache.fp_index[blk] = i
        cache.fp_k[i] = b.k_cache[blk]
        cache.fp_v[i] = b.v_cache[blk]
    return b, cache


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_kernel_matches_torch_quantizer(bits: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(bits)
    n, bs, hkv, d, gs = 3, 16, 2, 64, 16
    # Keys with per-channel offsets/scales (the outlier channels per-channel quantization is for).
    k = (torch.randn(n, bs, hkv, d, generator=g) * torch.rand(d, generator=g) * 4 + torch.randn(d, generator=g))
    v = torch.randn(n, bs, hkv, d, generator=g)
    k, v = k.to(torch.bfloat16).to(device), v.to(torch.bfloat16).to(device)
    cache = QuantKVCache.allocate(6, 1, bs, hkv, d, bits=bits, group_size=gs, device=device)
    dst = torch.tensor([4, 1, 5], device=device)
    quantize_write_kv(k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), cache, dst, torch.arange(n, device=device) * bs)
    kc, ks, kz, vc, vs, vz = torch_kernels.quantize_blocks(k, v, bits, gs)
    k_codes, v_codes = cache.k_codes[dst], cache.v_codes[dst]
    if bits == 4:
        k_codes, v_codes = torch_kernels.unpack_int4(k_codes), torch_kernels.unpack_int4(v_codes)
    assert torch.equal(k_codes.float(), kc) and torch.equal(v_codes.float(), vc)
    assert torch.equal(cache.k_scale[dst].float(), ks) and torch.equal(cache.k_zero[dst].float(), kz)
    assert torch.equal(cache.v_scale[dst].float(), vs) and torch.equal(cache.v_zero[dst].float(), vz)
    assert (cache.fp_index[dst] == -1).all()


@pytest.mark.parametrize("num_splits", [None, 2], ids=["single", "split"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quant_attention_matches_reference_on_dequantized_cache(bits: int, num_splits: int | None, device) -> None:
    b, cache = _quantized_batch(bits, torch.float32, device)
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    scale = b.query.shape[-1] ** -0.5
    out = paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                                num_splits=num_splits, out=poisoned_like(b.query))  # fmt: skip
    ref = torch_kernels.paged_attention(b.query, k_deq, v_deq, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    check(f"paged_attention_int{bits}", out, ref, torch.float32)


@pytest.mark.parametrize("protected", ["protected", "all"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_error_vs_16bit(bits: int, protected: str, device: torch.device) -> None:
    b, cache = _quantized_batch(bits, torch.bfloat16, device, protect=protected == "protected")
    scale = b.query.shape[-1] ** -0.5
    out = paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    f32 = [t.float() for t in (b.query, b.k_cache, b.v_cache)]
    ref16 = torch_kernels.paged_attention(f32[0], f32[1], f32[2], b.block_tables, b.seq_lens, b.query_start_loc, scale)
    err = rel_err(out.float(), ref16)
    key = (f"int{bits}_vs_16bit_{protected}", "bfloat16")
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), err)
    assert err < QUANT_ERROR_LIMIT[bits, protected], f"int{bits} ({protected}) attention error {err:.3g}"


def test_fp_window_lifecycle(device: torch.device) -> None:
    """Tokens land 16-bit (write_kv_fp), a full block leaves the window (quantize_fp_blocks), attention
    reads the mix of both pools in one call."""
    hkv, d, bs = 1, 64, 16
    g = torch.Generator().manual_seed(21)
    cache = QuantKVCache.allocate(4, 2, bs, hkv, d, bits=8, group_size=32, device=device)
    cache.fp_index[torch.tensor([1, 2])] = torch.tensor([0, 1], dtype=torch.int32)
    key = torch.randn(20, hkv, d, generator=g).to(device)
    value = torch.randn(20, hkv, d, generator=g).to(device)
    slots = torch.cat([torch.arange(16, 32), torch.arange(32, 36)]).to(device)  # block 1 full, block 2 partial
    write_kv_fp(key, value, cache, slots)
    quantize_fp_blocks(cache, torch.tensor([1], device=device))
    assert cache.fp_index.tolist() == [-1, -1, 1, -1]
    tables = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([20], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    q = torch.randn(1, 2, d, generator=g).to(device)
    out = paged_attention_quant(q, cache, tables, seq_lens, qsl, d**-0.5, out=poisoned_like(q))
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    assert torch.equal(k_deq[2, :4], key[16:].to(cache.fp_k.dtype).float())  # the 16-bit tail is stored as is
    check("paged_attention_int8", out, torch_kernels.paged_attention(q, k_deq, v_deq, tables, seq_lens, qsl, d**-0.5),
          torch.float32)  # fmt: skip
    dense_k = torch.zeros(4, bs, hkv, d, device=device)
    dense_v = torch.zeros(4, bs, hkv, d, device=device)
    dense_k.view(-1, hkv, d)[slots] = key
    dense_v.view(-1, hkv, d)[slots] = value
    full = paged_attention(q, dense_k, dense_v, tables, seq_lens, qsl, d**-0.5)
    assert rel_err(out, full) < 1e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_entry_points_agree_between_backends(bits: int, device: torch.device) -> None:
    """What the engine calls (``AttentionBackend.quantize_blocks``, ``write_kv_quant``,
    ``paged_attention_quant``) gives the same codes and, in float32, attention within 1e-5 (relative) on
    the torch reference and on the Triton kernels: blocks packed from 16-bit slots, the sink block and
    the last block of each sequence left 16-bit, new tokens written into 16-bit blocks."""
    from sinkserve_kernels.backend import torch_backend, triton_backend

    hkv, d, bs = 2, 32, 16
    b = make_batch([1, 1, 5], [1, 40, 37], 4, hkv, d, bs, torch.float32, device=device, seed=5 + bits)
    nb = b.k_cache.shape[0]
    g = torch.Generator().manual_seed(bits)
    t = int(b.query_start_loc[-1])
    key, value = torch.randn(t, hkv, d, generator=g).to(device), torch.randn(t, hkv, d, generator=g).to(device)
    slots = []
    for s, n in enumerate(b.seq_lens.tolist()):
        q_len = int(b.query_start_loc[s + 1] - b.query_start_loc[s])
        slots += [int(b.block_tables[s, p // bs]) * bs + p % bs for p in range(n - q_len, n)]
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    outs, codes = {}, {}
    for name, backend in (("torch", torch_backend()), ("triton", triton_backend())):
        cache = QuantKVCache.allocate(nb, nb, bs, hkv, d, bits=bits, group_size=16, dtype=torch.float32, device=device)
        cache.fp_k.copy_(b.k_cache)
        cache.fp_v.copy_(b.v_cache)
        cache.fp_index.copy_(torch.arange(nb, dtype=torch.int32))
        keep = set()
        for s, n in enumerate(b.seq_lens.tolist()):
            keep |= {int(b.block_tables[s, 0]), int(b.block_tables[s, -(-n // bs) - 1])}
        pack = torch.tensor(sorted(set(range(1, nb)) - keep), dtype=torch.long, device=device)
        backend.quantize_blocks(cache, pack, pack.clone())
        assert (cache.fp_index[pack] == -1).all()
        backend.write_kv_quant(key, value, cache, slot_mapping)
        out = backend.paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens, b.query_start_loc, d ** -0.5)
        outs[name], codes[name] = out, (cache.k_codes[pack].clone(), cache.v_codes[pack].clone())
    assert torch.equal(codes["torch"][0], codes["triton"][0]) and torch.equal(codes["torch"][1], codes["triton"][1])
    assert rel_err(outs["triton"], outs["torch"]) < 1e-5


@pytest.mark.parametrize("num_splits", [None, 2], ids=["single", "split"])
def test_quant_attention_window_and_sinks(num_splits: int | None, device) -> None:
    # A sliding-window layer with learned sinks over a quantized cache: the Triton kernel and the torch
    # quantized reference both equal the plain reference on the dequantized cache.
    b, cache = _quantized_batch(8, torch.float32, device)
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    scale, window = b.query.shape[-1] ** -0.5, 20
    sinks = torch.linspace(-2.0, 3.0, b.query.shape[1], device=device)
    args = (b.block_tables, b.seq_lens, b.query_start_loc, scale)
    want = torch_kernels.paged_attention(b.query, k_deq, v_deq, *args, window=window, sinks=sinks)
    out = paged_attention_quant(b.query, cache, *args, window=window, sinks=sinks, num_splits=num_splits,
                                out=poisoned_like(b.query))
    check("paged_attention_int8_window_sinks", out, want, torch.float32)
    check("paged_attention_int8_window_sinks", torch_kernels.paged_attention_quant(b.query, cache, *args, window=window,
                                                                              sinks=sinks), want, torch.float32)
    # The window changes the result (70 and 60 tokens > 20), so the test would see a kernel ignoring it.
    assert rel_err(torch_kernels.paged_attention(b.query, k_deq, v_deq, *args, sinks=sinks), want) > 1e-2
