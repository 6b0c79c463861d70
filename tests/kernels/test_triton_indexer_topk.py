"""Lightning indexer scores, top-k selection with a forced set, and the row-chunked indexer -> top-k
driver against the torch references (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import torch_kernels
from sinkserve_kernels.indexer import indexer_scores, indexer_topk, rows_per_chunk
from sinkserve_kernels.topk import topk_select
from tests.kernels.kernel_cases import check, make_batch

BS = 16
Q_LENS = [1, 6, 1, 1]
SEQ_LENS = [1, 38, 16, 70]  # length 1, a chunk crossing blocks, at a boundary, long with a null block


def _indexer_inputs(device: torch.device, key_dtype: str, seed: int = 0):
    b = make_batch(Q_LENS, SEQ_LENS, 2, 1, 64, BS, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    num_blocks = b.k_cache.shape[0]
    hi, di = 4, 32
    q = torch.randn(sum(Q_LENS), hi, di, generator=g)
    w = torch.randn(sum(Q_LENS), hi, generator=g)
    keys = torch.randn(num_blocks, BS, di, generator=g)
    scale = None
    if key_dtype == "int8":
        # Symmetric int8 with one fp32 scale per token (emulates a low-precision indexer cache).
        amax = keys.abs().amax(-1)
        scale = amax / 127
        keys = (keys / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
        scale = scale.to(device)
    elif key_dtype == "bf16":
        q, keys = q.to(torch.bfloat16), keys.to(torch.bfloat16)
    return b, q.to(device), w.to(device), keys.to(device), scale


@pytest.mark.parametrize("key_dtype", ["fp32", "bf16", "int8"])
def test_indexer_scores_match_reference(key_dtype: str, device: torch.device) -> None:
    b, q, w, keys, scale = _indexer_inputs(device, key_dtype)
    out = torch.full((q.shape[0], b.block_tables.shape[1] * BS), float("nan"), device=device)
    got = indexer_scores(q, w, keys, b.block_tables, b.seq_lens, b.query_start_loc, idx_k_scale=scale, out=out)
    ref = torch_kernels.indexer_scores(q, w, keys, b.block_tables, b.seq_lens, b.query_start_loc, idx_k_scale=scale)
    visible = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), visible)  # -inf exactly where invisible, nothing left NaN
    assert (got[~visible] == float("-inf")).all()
    dtype = torch.bfloat16 if key_dtype == "bf16" else torch.float32
    check(f"indexer_{key_dtype}", got[visible], ref[visible], dtype)


def _positions(b) -> torch.Tensor:
    q_lens = (b.query_start_loc[1:] - b.query_start_loc[:-1]).long()
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens.cpu())
    local = torch.arange(int(q_lens.sum())) - b.query_start_loc[:-1].long().cpu()[seq_of]
    return seq_of, b.seq_lens.long().cpu()[seq_of] - q_lens.cpu()[seq_of] + local


@pytest.mark.parametrize("k,window", [(6, 3), (16, 4), (100, 8)], ids=["k6", "k16", "k_gt_len"])
def test_topk_matches_reference_and_keeps_forced(k: int, window: int, device: torch.device) -> None:
    b, q, w, keys, _ = _indexer_inputs(device, "fp32", seed=2)
    scores = torch_kernels.indexer_scores(q, w, keys, b.block_tables, b.seq_lens, b.query_start_loc)
    n = scores.shape[1]
    forced = torch.zeros(len(SEQ_LENS), n, dtype=torch.bool, device=device)
    forced[:, :2] = True  # two attention sinks
    out = torch.full((q.shape[0], k), -7, dtype=torch.int32, device=device)  # poison: -7 is never written
    got = topk_select(scores, k, b.block_tables, b.seq_lens, b.query_start_loc, BS, window, forced, out=out)
    ref = torch_kernels.topk_select(scores, k, b.block_tables, b.seq_lens, b.query_start_loc, BS, window, forced)
    assert torch.equal(got, ref)

    # Properties, independent of the reference: slots map back to visible positions <= the query's own,
    # every forced visible position is present, padding is -1 at the end.
    seq_of, pos = _positions(b)
    tables = b.block_tables.cpu().long()
    for t in range(got.shape[0]):
        row = got[t].cpu().tolist()
        chosen = [s for s in row if s >= 0]
        assert row == chosen + [-1] * (k - len(chosen))
        slot_to_pos = {int(tables[seq_of[t], p // BS]) * BS + p % BS: p for p in range(int(pos[t]) + 1)
                       if int(tables[seq_of[t], p // BS]) != 0}  # fmt: skip
        assert all(s in slot_to_pos for s in chosen)
        positions = [slot_to_pos[s] for s in chosen]
        assert positions == sorted(positions)
        must = {p for p in slot_to_pos.values() if p < 2 or p > pos[t] - window}
        assert must <= set(positions)
        assert len(chosen) == min(k, len(slot_to_pos))


def test_topk_ties_and_all_forced_rows(device: torch.device) -> None:
    # Constant scores: every row is ties only, resolved toward lower positions like the reference.
    b = make_batch([3], [40], 2, 1, 64, BS, device=device, seed=5)
    scores = torch.ones(3, b.block_tables.shape[1] * BS, device=device)
    got = topk_select(scores, 8, b.block_tables, b.seq_lens, b.query_start_loc, BS, window=2)
    ref = torch_kernels.topk_select(scores, 8, b.block_tables, b.seq_lens, b.query_start_loc, BS, window=2)
    assert torch.equal(got, ref)


def test_indexer_topk_chunks_rows_within_budget(device: torch.device) -> None:
    b, q, w, keys, _ = _indexer_inputs(device, "fp32", seed=3)
    n = b.block_tables.shape[1] * BS
    budget = 3 * n * 4  # three fp32 score rows: forces several chunks over the 9 query tokens
    assert rows_per_chunk(n, budget) == 3
    forced = torch.zeros(len(SEQ_LENS), n, dtype=torch.bool, device=device)
    forced[:, 0] = True
    got = indexer_topk(q, w, keys, b.block_tables, b.seq_lens, b.query_start_loc, 10, window=4, forced_mask=forced,
                       memory_budget_bytes=budget)  # fmt: skip
    scores = torch_kernels.indexer_scores(q, w, keys, b.block_tables, b.seq_lens, b.query_start_loc)
    ref = torch_kernels.topk_select(scores, 10, b.block_tables, b.seq_lens, b.query_start_loc, BS, 4, forced)
    assert torch.equal(got, ref)


def test_topk_2048_over_long_rows(device: torch.device) -> None:
    """k = 2,048 (the serving value) over rows longer than k: the radix search actually runs."""
    b = make_batch([1, 1], [2300, 2100], 2, 1, 64, BS, device=device, seed=8)
    g = torch.Generator().manual_seed(8)
    scores = torch.randn(2, b.block_tables.shape[1] * BS, generator=g).to(device)
    forced = torch.zeros(2, scores.shape[1], dtype=torch.bool, device=device)
    forced[:, :4] = True
    out = torch.full((2, 2048), -7, dtype=torch.int32, device=device)
    got = topk_select(scores, 2048, b.block_tables, b.seq_lens, b.query_start_loc, BS, 64, forced, out=out)
    ref = torch_kernels.topk_select(scores, 2048, b.block_tables, b.seq_lens, b.query_start_loc, BS, 64, forced)
    assert torch.equal(got, ref)
    assert (got >= 0).sum().item() == 2 * 2048
