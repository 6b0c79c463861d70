"""Block-bounds (Quest) selection and block-sparse attention: bounds upkeep, the selection rules (forced
set never counted against top_k, exact top block), dense equivalence when top_k covers the context, and
the Triton path (interpreter on CPU) attending the same selection as the torch path."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import block_sparse as bs
from sinkserve_kernels import torch_kernels
from sinkserve_kernels.kv_quant import QuantKVCache
from tests.kernels.kernel_cases import make_batch

BS = 16


def _bounds_of(k_cache: torch.Tensor) -> bs.BlockBounds:
    return bs.BlockBounds.of(k_cache.amin(1), k_cache.amax(1))


def _plan(b, top_blocks: int, window: int = 16, forced: dict[int, list[int]] | None = None) -> bs.SparsePlan:
    mask = torch.zeros(b.block_tables.shape, dtype=torch.bool)
    for s, blocks in (forced or {}).items():
        mask[s, blocks] = True
    return bs.SparsePlan(mask, [top_blocks] * b.block_tables.shape[0], window)


def test_update_bounds_tracks_writes_and_resets_reused_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(4, BS, 2, 8)
    bounds = bs.BlockBounds.allocate(4, 2, 8, torch.float32, "cpu")
    bounds.kmin.fill_(-100.0)  # stale bounds of a previous owner of block 2
    bounds.kmax.fill_(100.0)
    # A prefill of 20 tokens into blocks 2, 3 then two decode writes: bounds equal min/max of what is there.
    slots = torch.cat([torch.arange(2 * BS, 3 * BS), torch.arange(3 * BS, 3 * BS + 6)])
    for chunk in (slots[:20], slots[20:21], slots[21:22]):
        key = torch.randn(len(chunk), 2, 8, generator=g)
        torch_kernels.write_kv(key, key, k_cache, k_cache.clone(), chunk)
        bs.update_bounds(bounds, key, chunk, BS)
    torch.testing.assert_close(bounds.kmin[2], k_cache[2].amin(0))
    torch.testing.assert_close(bounds.kmax[3], k_cache[3, :6].amax(0))
    bs.copy_bounds(bounds, torch.tensor([3]), torch.tensor([1]))
    torch.testing.assert_close(bounds.kmax[1], k_cache[3, :6].amax(0))


def test_forced_set_does_not_count_against_top_k_and_best_block_wins() -> None:
    d, hkv = 8, 1
    nb = 12
    k_cache = torch.randn(nb + 1, BS, hkv, d, generator=torch.Generator().manual_seed(1)) * 0.1
    query = torch.zeros(1, 1, d)
    query[0, 0, 0] = 1.0
    k_cache[7, 3, 0, 0] = 50.0  # logical block 6 (physical 7) holds the one key that matches the query
    table = torch.arange(1, nb + 1, dtype=torch.int32)[None]
    seq_len = nb * BS
    plan = bs.SparsePlan(torch.zeros(1, nb, dtype=torch.bool).index_fill_(1, torch.tensor([0, 2]), True), [1], 16)
    sel: list[torch.Tensor] = []
    bs.block_sparse_attention(query, (k_cache, k_cache), _bounds_of(k_cache), table, torch.tensor([seq_len]),
                              torch.tensor([0, 1]), plan, d**-0.5, selections=sel)
    # forced: protected 0, 2 and the window's block 11; top_k 1 block: block 6.
    assert sel[0][0].nonzero().flatten().tolist() == [0, 2, 6, 11]


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "int8"])
def test_top_k_covering_the_context_is_dense_attention(quant: bool) -> None:
    b = make_batch([1, 70, 1], [40, 150, 97], 4, 2, 32, BS, seed=3)
    big = 64  # more blocks than any sequence has: selection keeps every visible block
    plan = _plan(b, big)
    if quant:
        cache = QuantKVCache.allocate(b.k_cache.shape[0], 1, BS, 2, 32, bits=8, group_size=16, dtype=torch.float32,
                                      device="cpu")
        torch_kernels.quantize_into(cache, torch.arange(b.k_cache.shape[0]), b.k_cache, b.v_cache)
        kv, dense = cache, torch_kernels.paged_attention_quant(b.query, cache, b.block_tables, b.seq_lens,
                                                           b.query_start_loc, 0.2)
    else:
        kv, dense = (b.k_cache, b.v_cache), torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables,
                                                                      b.seq_lens, b.query_start_loc, 0.2)
    out = bs.block_sparse_attention(b.query, kv, _bounds_of(b.k_cache), b.block_tables, b.seq_lens,
                                    b.query_start_loc, plan, 0.2)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_sparse_selection_attends_only_selected_blocks() -> None:
    b = make_batch([1, 130], [300, 260], 4, 2, 32, BS, seed=5)
    plan = _plan(b, 2, window=16, forced={0: [0], 1: [0]})
    sel: list[torch.Tensor] = []
    out = bs.block_sparse_attention(b.query, (b.k_cache, b.v_cache), _bounds_of(b.k_cache), b.block_tables,
                                    b.seq_lens, b.query_start_loc, plan, 0.2, selections=sel)
    # Reference: per query token, dense attention restricted to its group's selected blocks' slots.
    parts = [bs.selection_slots(torch.arange(n - q, n), b.block_tables[s, : -(-n // BS)], sel[s], n, BS,
                                1 if q == 1 else bs.PREFILL_GROUP)
             for s, (q, n) in enumerate([(1, 300), (130, 260)])]
    width = max(p.shape[1] for p in parts)
    slots = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])
    assert int((slots >= 0).sum(1).max()) < 200  # a true subset of the 300 / 260 positions
    ref = torch_kernels.sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for s in sel:  # each group: <= forced (protected + window/diagonal blocks) + 2 selected
        assert int(s.sum(1).max()) <= 1 + 2 + 2 + -(-bs.PREFILL_GROUP // BS) + 1


@pytest.mark.parametrize("n", [1, 127, 128, 129, 256, 300])
def test_prefill_groups_split_at_the_group_size(n: int) -> None:
    """A chunk of n queries selects in ceil(n / PREFILL_GROUP) groups (one row for a decode token); each
    group's selection is the one its mean query makes alone, and its rows attend exactly that selection."""
    grp = bs.PREFILL_GROUP
    seq_len = 600
    b = make_batch([n], [seq_len], 4, 2, 32, BS, seed=11)
    plan = _plan(b, 3, window=16, forced={0: [0]})
    bounds = _bounds_of(b.k_cache)
    sel: list[torch.Tensor] = []
    out = bs.block_sparse_attention(b.query, (b.k_cache, b.v_cache), bounds, b.block_tables, b.seq_lens,
                                    b.query_start_loc, plan, 0.2, selections=sel)
    group = 1 if n == 1 else grp
    assert sel[0].shape[0] == -(-n // group)
    nb = -(-seq_len // BS)
    table = b.block_tables[0, :nb]
    for i in range(sel[0].shape[0]):
        a, z = i * group, min(n, (i + 1) * group)
        alone = bs.select_blocks(b.query[a:z].mean(0, keepdim=True), bounds, table, plan.forced[0, :nb],
                                 torch.tensor([seq_len - n + a]), torch.tensor([seq_len - n + z - 1]), 3, 16, BS, 0.2)
        assert torch.equal(sel[0][i], alone[0]), i
    slots = bs.selection_slots(torch.arange(seq_len - n, seq_len), table, sel[0], seq_len, BS, group)
    torch.testing.assert_close(out, torch_kernels.sparse_attention(b.query, b.k_cache, b.v_cache, slots, 0.2),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_paged_decode_equals_the_gather_path(quant: bool, backend: str) -> None:
    """Decode tokens of several sequences attend their selections in one paged call over compacted tables
    (the cpu backend: the C kernel): the same output as the per-sequence gather, with null blocks, partial
    last blocks and a prefill sequence in the same step (which keeps the gather path)."""
    from sinkserve_kernels.backend import BACKENDS

    b = make_batch([1, 1, 40, 1], [300, 161, 200, 97], 4, 2, 32, BS, seed=21)
    plan = _plan(b, 3, window=16, forced={0: [0], 1: [0, 4], 2: [0], 3: []})
    if quant:
        kv = QuantKVCache.allocate(b.k_cache.shape[0], 1, BS, 2, 32, bits=8, group_size=16, dtype=torch.float32,
                                   device="cpu")
        torch_kernels.quantize_into(kv, torch.arange(b.k_cache.shape[0]), b.k_cache, b.v_cache)
    else:
        kv = (b.k_cache, b.v_cache)
    bounds = _bounds_of(b.k_cache)
    args = (b.query, kv, bounds, b.block_tables, b.seq_lens, b.query_start_loc, plan, 0.2)
    sel_g: list[torch.Tensor] = []
    sel_p: list[torch.Tensor] = []
    gathered = bs.block_sparse_attention(*args, selections=sel_g)
    paged = BACKENDS[backend]().block_sparse_attention(*args, selections=sel_p)
    assert all(torch.equal(a, c) for a, c in zip(sel_g, sel_p))
    torch.testing.assert_close(paged, gathered, atol=1e-5, rtol=1e-5)


def test_compact_mode_keeps_its_smaller_prefill_group() -> None:
    from engine.worker.sparse_config import COMPACT_PREFILL_GROUP, SparseAttention

    from types import SimpleNamespace

    from engine.worker import sparse_runtime

    # Resolved budgets, as the engine passes them (engine/limits.py fills a config's None values).
    resolved = dict(top_k=64, min_context=128, local_window=32)
    for sparse, group in ((SparseAttention(enabled=True, **resolved), bs.PREFILL_GROUP),
                          (SparseAttention(enabled=True, position_mode="compact", **resolved), COMPACT_PREFILL_GROUP)):
        assert sparse.prefill_group == group
        # The step's plan carries the mode's group to the kernels.
        step = sparse_runtime.plan([[0]], SimpleNamespace(sparse=sparse, block_size=BS), 4, torch.device("cpu"))
        assert step.prefill_group == group
    assert (bs.PREFILL_GROUP, COMPACT_PREFILL_GROUP) == (128, 64)


@pytest.mark.parametrize("quant", [False, True], ids=["fp32", "int8"])
def test_triton_path_matches_torch_path(quant: bool, device) -> None:
    """Same selection (shared code), same output: Triton sparse kernel vs the torch gather path (the CPU
    interpreter here; compiled on a CUDA machine)."""
    b = make_batch([1, 40], [200, 180], 4, 2, 32, BS, seed=9, device=device)
    plan = _plan(b, 3, window=16, forced={0: [0], 1: [0, 2]})
    plan = bs.SparsePlan(plan.forced.to(device), plan.top_blocks, plan.window)
    if quant:
        kv = QuantKVCache.allocate(b.k_cache.shape[0], 1, BS, 2, 32, bits=8, group_size=16, dtype=torch.float32,
                                   device=device)
        torch_kernels.quantize_into(kv, torch.arange(b.k_cache.shape[0], device=device), b.k_cache, b.v_cache)
    else:
        kv = (b.k_cache, b.v_cache)
    bounds = _bounds_of(b.k_cache)
    sel_t: list[torch.Tensor] = []
    sel_x: list[torch.Tensor] = []
    out_t = bs.block_sparse_attention(b.query, kv, bounds, b.block_tables, b.seq_lens, b.query_start_loc, plan, 0.2,
                                      attend=bs.attend_gather, selections=sel_t)
    out_x = bs.block_sparse_attention(b.query, kv, bounds, b.block_tables, b.seq_lens, b.query_start_loc, plan, 0.2,
                                      attend=bs.attend_slots_triton, selections=sel_x)
    assert all(torch.equal(a, c) for a, c in zip(sel_t, sel_x))
    assert 0 < int(sel_t[0].sum()) <= 1 + 2 + 3 < 12  # decode row: sink + window + 3 of its 12 visible blocks
    torch.testing.assert_close(out_x, out_t, atol=2e-4, rtol=2e-4)
