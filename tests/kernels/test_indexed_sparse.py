"""The trained indexer's token-sparse attention (sinkserve_kernels/indexed_sparse.py): the torch selection equals the
reference indexer + top-k (sinkserve_kernels/torch_kernels.py), the Triton indexer + top-k kernels select exactly the same
slots (interpreter on CPU), the forced set is always in and never counted against top_k, and a budget
covering the context is dense attention."""

from __future__ import annotations

import pytest
import torch

from engine.worker.lightning import quantize_keys
from sinkserve_kernels import block_sparse as bs
from sinkserve_kernels import indexed_sparse as ix
from sinkserve_kernels import torch_kernels
from sinkserve_kernels.kv_quant import QuantKVCache
from tests.kernels.kernel_cases import make_batch

BS = 16
HI, DI = 2, 16


def _index(b, seed: int, device="cpu") -> tuple[ix.IndexCache, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    nb = b.k_cache.shape[0]
    cache = ix.IndexCache.allocate(nb, BS, DI, "cpu")
    codes, scale = quantize_keys(torch.randn(nb * BS, DI, generator=g))
    cache.write(codes, scale, torch.arange(nb * BS))
    t = b.query.shape[0]
    iq = torch.randn(t, HI, DI, generator=g)
    iw = torch.rand(t, HI, generator=g)
    return ix.IndexCache(cache.keys.to(device), cache.scale.to(device)), iq.to(device), iw.to(device)


def _plan(b, top_tokens: int, window: int, forced: dict[int, list[int]]) -> bs.SparsePlan:
    mask = torch.zeros(b.block_tables.shape, dtype=torch.bool, device=b.block_tables.device)
    for s, blocks in forced.items():
        mask[s, blocks] = True
    return bs.SparsePlan(mask, [top_tokens // BS] * b.block_tables.shape[0], window, top_tokens=top_tokens)


def test_torch_selection_equals_reference_indexer_and_topk() -> None:
    b = make_batch([1, 90, 1], [300, 260, 50], 4, 2, 32, BS, seed=1)
    cache, iq, iw = _index(b, 2)
    plan = _plan(b, 40, 24, {0: [0], 1: [0, 3], 2: [0]})
    sel: list[torch.Tensor] = []
    ix.indexed_sparse_attention(b.query, (b.k_cache, b.v_cache), iq, iw, cache, b.block_tables, b.seq_lens,
                                b.query_start_loc, plan, 0.2, selections=sel)
    starts = b.query_start_loc.tolist()
    for s, n in enumerate(b.seq_lens.tolist()):
        r0, r1 = starts[s], starts[s + 1]
        nb = -(-n // BS)
        bt, lens = b.block_tables[s : s + 1, :nb], torch.tensor([n])
        qsl = torch.tensor([0, r1 - r0])
        forced_mask = plan.forced[s : s + 1, :nb].repeat_interleave(BS, 1)
        k = sel[s].shape[1]
        scores = torch_kernels.indexer_scores(iq[r0:r1], iw[r0:r1], cache.keys, bt, lens, qsl, cache.scale, nb * BS)
        ref = torch_kernels.topk_select(scores, k, bt, lens, qsl, BS, 24, forced_mask)
        assert torch.equal(sel[s], ref), s
    # Forced set never counted against top_k: the decode row of seq 0 holds block 0 (16), the window (24)
    # and exactly 40 more tokens.
    assert int((sel[0][0] >= 0).sum()) == 16 + 24 + 40
    visible2 = 50 - (0 if b.block_tables[2, 1] else 16)
    assert int((sel[2][0] >= 0).sum()) == min(visible2, 16 + 24 + 40)


def test_triton_indexer_and_topk_select_the_same_slots(device) -> None:
    """Identical selections: sinkserve_kernels/indexer.py + sinkserve_kernels/topk.py vs the torch selection (int8 index keys)."""
    b = make_batch([1, 70], [400, 230], 4, 2, 32, BS, seed=4)
    cache, iq, iw = _index(b, 5)
    plan = _plan(b, 48, 32, {0: [0, 5], 1: [0]})
    sel_t: list[torch.Tensor] = []
    out_t = ix.indexed_sparse_attention(b.query, (b.k_cache, b.v_cache), iq, iw, cache, b.block_tables, b.seq_lens,
                                        b.query_start_loc, plan, 0.2, selections=sel_t)
    d = lambda t: t.to(device)  # noqa: E731
    cache_d = ix.IndexCache(d(cache.keys), d(cache.scale))
    plan_d = bs.SparsePlan(d(plan.forced), plan.top_blocks, plan.window, top_tokens=plan.top_tokens)
    sel_x: list[torch.Tensor] = []
    out_x = ix.indexed_sparse_attention(d(b.query), (d(b.k_cache), d(b.v_cache)), d(iq), d(iw), cache_d,
                                        d(b.block_tables), d(b.seq_lens), d(b.query_start_loc), plan_d, 0.2,
                                        select=ix.select_triton, attend=ix.attend_triton, selections=sel_x)
    for a, c in zip(sel_t, sel_x):
        assert torch.equal(a, c.cpu())
    torch.testing.assert_close(out_x.cpu(), out_t, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "int8"])
def test_budget_covering_the_context_is_dense_attention(quant: bool) -> None:
    b = make_batch([1, 70, 1], [40, 150, 97], 4, 2, 32, BS, seed=3)
    cache, iq, iw = _index(b, 6)
    plan = _plan(b, 1024, 16, {})
    if quant:
        kv = QuantKVCache.allocate(b.k_cache.shape[0], 1, BS, 2, 32, bits=8, group_size=16, dtype=torch.float32,
                                   device="cpu")
        torch_kernels.quantize_into(kv, torch.arange(b.k_cache.shape[0]), b.k_cache, b.v_cache)
        dense = torch_kernels.paged_attention_quant(b.query, kv, b.block_tables, b.seq_lens, b.query_start_loc, 0.2)
    else:
        kv = (b.k_cache, b.v_cache)
        dense = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                          b.query_start_loc, 0.2)
    out = ix.indexed_sparse_attention(b.query, kv, iq, iw, cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                      plan, 0.2)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_sparse_output_is_attention_over_the_selected_tokens_only() -> None:
    b = make_batch([1, 64], [300, 200], 4, 2, 32, BS, seed=8)
    cache, iq, iw = _index(b, 9)
    plan = _plan(b, 32, 16, {0: [0], 1: [0]})
    sel: list[torch.Tensor] = []
    out = ix.indexed_sparse_attention(b.query, (b.k_cache, b.v_cache), iq, iw, cache, b.block_tables, b.seq_lens,
                                      b.query_start_loc, plan, 0.2, selections=sel)
    width = max(s.shape[1] for s in sel)
    slots = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1) for s in sel])
    assert int((slots >= 0).sum(1).max()) <= 16 + 16 + 32 < 200
    ref = torch_kernels.sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_select_top_is_a_stable_descending_sorts_first_k() -> None:
    g = torch.Generator().manual_seed(12)
    key = torch.randint(0, 4, (64, 40), generator=g).float()  # many ties at every threshold
    key[:, :3] = float("inf")
    key[5:, -6:] = float("-inf")
    valid = key > float("-inf")
    k = torch.randint(1, 45, (64,), generator=g)
    got = ix.select_top(key, valid, k)
    for r in range(64):
        order = torch.sort(key[r], descending=True, stable=True).indices[: int(k[r])]
        want = torch.zeros(40, dtype=torch.bool).index_fill_(0, order, True) & valid[r]
        assert torch.equal(got[r], want), r


@pytest.mark.parametrize("budget", [ix.MEMORY_BUDGET, 4 * 16 * 500], ids=["one batch", "split rows"])
def test_batched_selection_equals_each_sequence_alone(budget: int, monkeypatch) -> None:
    """Every row of a step selects together (decode rows of several sequences with different k, a prefill
    split across batches when the score budget is small): the same slots as each sequence alone and as
    the reference indexer + top-k; decode rows attend their own tokens in one call (attend_rows)."""
    monkeypatch.setattr(ix, "MEMORY_BUDGET", budget)
    b = make_batch([1, 1, 75, 1], [300, 170, 240, 90], 4, 2, 32, BS, seed=13)
    cache, iq, iw = _index(b, 14)
    forced = {0: [0], 1: [0, 4], 2: [0, 2], 3: []}
    plan = _plan(b, 48, 24, forced)
    sel: list[torch.Tensor] = []
    out = ix.indexed_sparse_attention(b.query, (b.k_cache, b.v_cache), iq, iw, cache, b.block_tables, b.seq_lens,
                                      b.query_start_loc, plan, 0.2, selections=sel)
    assert len({s.shape[1] for s in sel}) > 1  # the sequences' k differ
    starts = b.query_start_loc.tolist()
    for s, n in enumerate(b.seq_lens.tolist()):
        r0, r1 = starts[s], starts[s + 1]
        nb = -(-n // BS)
        seq = ix.SeqRows(0, r1 - r0, n, b.block_tables[s, :nb], plan.forced[s, :nb].repeat_interleave(BS),
                         sel[s].shape[1])
        alone = ix.select_torch(iq[r0:r1], iw[r0:r1], cache, [seq], 24)[0]
        assert torch.equal(sel[s], alone), s
        scores = torch_kernels.indexer_scores(iq[r0:r1], iw[r0:r1], cache.keys, b.block_tables[s : s + 1, :nb],
                                          torch.tensor([n]), torch.tensor([0, r1 - r0]), cache.scale, nb * BS)
        ref = torch_kernels.topk_select(scores, sel[s].shape[1], b.block_tables[s : s + 1, :nb], torch.tensor([n]),
                                    torch.tensor([0, r1 - r0]), BS, 24, seq.forced_mask[None])
        assert torch.equal(sel[s], ref), s
    width = max(s.shape[1] for s in sel)
    slots = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1) for s in sel])
    torch.testing.assert_close(out, torch_kernels.sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.2),
                               atol=1e-5, rtol=1e-5)
