"""The torch packed-KV decode path (sinkserve_kernels/packed_decode.py): the split-by-precision gather with exact
block ids, attention equal to dequantize-then-attend, the per-step memo, and the workspace."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import packed_decode, torch_kernels
from sinkserve_kernels.kv_quant import QuantKVCache
from sinkserve_kernels.workspace import Workspace
from tests.kernels.kernel_cases import make_batch, rel_err


def _decode_plan(tables: list[list[int]], lens: list[int], block_size: int, window: int | None = None):
    bt = torch.tensor(tables, dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    return torch_kernels.plan_attention(bt, sl, qsl, block_size, window)


def test_split_gather_puts_each_rows_packed_blocks_first_then_its_16bit_slots() -> None:
    # The module docstring's example, block_size 4: sequence 0 = [7 (16-bit) | 12 | 3 | 9 (16-bit)] with
    # 14 tokens (block 9 holds 2), sequence 1 = [5 (16-bit) | 8 (16-bit)] with 8 tokens.
    fp_index = torch.full((16,), -1, dtype=torch.int32)
    for block, slot in {7: 0, 9: 1, 5: 2, 8: 3}.items():
        fp_index[block] = slot
    plan = _decode_plan([[7, 12, 3, 9], [5, 8, 0, 0]], [14, 8], 4)
    sg = packed_decode.build_split_gather(plan.decode, plan.decode_mask, fp_index, 4)
    assert (sg.wp, sg.wf) == (2, 2)
    assert sg.packed.view(2, 2).tolist() == [[12, 3], [0, 0]]
    assert sg.slots.view(2, 2).tolist() == [[0, 1], [2, 3]]
    mask = sg.mask.view(2, 4, 4)
    assert mask[0].tolist() == [[True] * 4, [True] * 4, [True] * 4, [True, True, False, False]]
    assert mask[1].tolist() == [[False] * 4, [False] * 4, [True] * 4, [True] * 4]


def test_split_gather_applies_the_sliding_window_to_both_parts() -> None:
    # Window 8 at position 13 sees 6..13: the window's table trimming drops block 7 (0..3) before the
    # split, block 12 (4..7) is half visible, block 3 (8..11) whole, block 9 (12, 13 of 12..15) in part.
    fp_index = torch.full((16,), -1, dtype=torch.int32)
    fp_index[7], fp_index[9] = 0, 1
    plan = _decode_plan([[7, 12, 3, 9]], [14], 4, window=8)
    sg = packed_decode.build_split_gather(plan.decode, plan.decode_mask, fp_index, 4)
    assert sg.packed.tolist() == [12, 3] and sg.slots.tolist() == [1]
    assert sg.mask.view(3, 4).tolist() == [[False, False, True, True], [True] * 4, [True, True, False, False]]


def _cache(b, bits: int, outliers: int, fp_blocks: list[int]) -> QuantKVCache:
    nb, bs, h, d = b.k_cache.shape
    cache = QuantKVCache.allocate(nb, len(fp_blocks) + 1, bs, h, d, bits=bits, group_size=8, dtype=torch.float32,
                                  outlier_channels=outliers)
    if outliers:
        cache.outlier_idx = torch.tensor([[[1, 9, 17, 30][:outliers]] * h])
    torch_kernels.quantize_into(cache, torch.arange(nb), b.k_cache, b.v_cache)
    for slot, block in enumerate(fp_blocks):
        cache.fp_index[block] = slot
        cache.fp_k[slot] = b.k_cache[block]
        cache.fp_v[slot] = b.v_cache[block]
    return cache


@pytest.mark.parametrize("bits,outliers", [(8, 0), (4, 2), (2, 4)])
def test_folded_scale_variant_equals_dequantize_then_attend(bits: int, outliers: int) -> None:
    # bench/kv_decode_variants.py's folded decode (scales folded into the query and the softmax weights,
    # no dequantized K/V) is the same attention: mixed 16-bit / packed rows, outlier channels, sinks.
    from bench.kv_decode_variants import folded_attention

    b = make_batch([1, 1, 1], [9, 70, 45], 8, 2, 32, 16, seed=7 + bits)
    tables = b.block_tables.tolist()
    used = [[blk for blk in row[: -(-n // 16)] if blk] for row, n in zip(tables, b.seq_lens.tolist())]
    cache = _cache(b, bits, outliers, sorted(set(used[0]) | {used[2][0], used[2][-1]}))
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    scale, sinks = 32 ** -0.5, torch.linspace(-2.0, 3.0, 8)
    plan = torch_kernels.plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 16)
    want = torch_kernels.paged_attention(b.query, k_deq, v_deq, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                                     sinks=sinks, plan=plan)
    got = folded_attention(b.query, cache, plan.decode, plan.decode_mask, scale, sinks)
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("bits,outliers", [(8, 0), (4, 0), (4, 2), (2, 4)])
@pytest.mark.parametrize("window_sinks", [False, True], ids=["full", "window_sinks"])
def test_packed_decode_equals_dequantize_then_attend(bits: int, outliers: int, window_sinks: bool) -> None:
    # Decode rows and a prefill chunk in one batch; row 0's blocks are all 16-bit, row 1's all packed, the
    # others mixed (first and last block 16-bit, as sinks and the residual window are).
    b = make_batch([1, 1, 1, 5], [9, 70, 45, 60], 8, 2, 32, 16, seed=bits + outliers)
    tables = b.block_tables.tolist()
    used = [[blk for blk in row[: -(-n // 16)] if blk] for row, n in zip(tables, b.seq_lens.tolist())]
    fp_blocks = sorted(set(used[0]) | {r[0] for r in used[2:]} | {r[-1] for r in used[2:]})
    cache = _cache(b, bits, outliers, fp_blocks)
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    scale = 32 ** -0.5
    kw = dict(window=20, sinks=torch.linspace(-2.0, 3.0, 8)) if window_sinks else {}
    args = (b.block_tables, b.seq_lens, b.query_start_loc, scale)
    want = torch_kernels.paged_attention(b.query, k_deq, v_deq, *args, **kw)
    got = torch_kernels.paged_attention_quant(b.query, cache, *args, **kw)
    assert rel_err(got, want) < 1e-6
    # Decode-only: the whole batch is one decode group.
    q1 = b.query[:3]
    sl, bt, qsl = b.seq_lens[:3], b.block_tables[:3], torch.arange(4, dtype=torch.int32)
    want = torch_kernels.paged_attention(q1, k_deq, v_deq, bt, sl, qsl, scale, **kw)
    assert rel_err(torch_kernels.paged_attention_quant(q1, cache, bt, sl, qsl, scale, **kw), want) < 1e-6


def test_split_gather_is_built_once_per_plan_and_rebuilt_when_fp_index_changes() -> None:
    b = make_batch([1, 1], [40, 70], 4, 2, 32, 16, seed=3)
    cache = _cache(b, 4, 0, [int(b.block_tables[0, 0])])
    plan = torch_kernels.plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 16)
    first = packed_decode.split_gather(plan, plan.decode, plan.decode_mask, cache)
    assert packed_decode.split_gather(plan, plan.decode, plan.decode_mask, cache) is first
    # Moving a block to the 16-bit pool (as the runner's "dequantize" op does) must change the split.
    block = int(b.block_tables[1, 0])
    cache.fp_index[block] = 0
    cache.fp_k[0], cache.fp_v[0] = b.k_cache[block], b.v_cache[block]
    second = packed_decode.split_gather(plan, plan.decode, plan.decode_mask, cache)
    assert second is not first and block not in second.packed.tolist()
    k_deq, v_deq = torch_kernels.dequantize_cache(cache)
    args = (b.block_tables, b.seq_lens, b.query_start_loc, 32 ** -0.5)
    want = torch_kernels.paged_attention(b.query, k_deq, v_deq, *args)
    assert rel_err(torch_kernels.paged_attention_quant(b.query, cache, *args, plan=plan), want) < 1e-6


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_unpack_codes_into_strided_output_equals_unpack_codes(bits: int) -> None:
    pool = torch.randint(0, 256, (6, 4, 2, 32 * bits // 8), dtype=torch.uint8)
    ids = torch.tensor([5, 0, 3, 3])
    out = torch.full((2, 3, 4, 2, 32), float("nan"))[:, 1:]  # strided over the leading dim
    packed_decode.unpack_codes_into(pool, ids, bits, out, "t")
    want = torch_kernels.unpack_codes(pool[ids], bits).float().view(2, 2, 4, 2, 32)
    assert torch.equal(out, want)


def test_workspace_reuses_buffers_and_keeps_none_above_its_limit() -> None:
    ws = Workspace(max_bytes=4096)
    a = ws.get("x", (16, 16), torch.float32, torch.device("cpu"))
    b = ws.get("x", (8, 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and ws.nbytes() == 1024
    big = ws.get("y", (64, 64), torch.float32, torch.device("cpu"))
    assert big.shape == (64, 64) and ws.nbytes() == 1024  # above the limit: fresh, not kept
    with torch.inference_mode():
        c = ws.get("x", (16, 16), torch.float32, torch.device("cpu"))
    assert c.is_inference() and c.data_ptr() != a.data_ptr()
    ws.get("x", (16, 16), torch.float32, torch.device("cpu")).fill_(1.0)  # outside inference mode: writable
