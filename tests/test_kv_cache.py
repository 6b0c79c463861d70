"""engine/worker/kv_cache.py: the KV cache object's block operations touch exactly the named blocks, dense and
packed, and what lives beside each block (sparse bounds, trained-indexer keys) follows it as a subscriber."""

from __future__ import annotations

import pytest
import torch

from engine.memory import kv_block_codec
from engine.worker.indexer_runtime import IndexerState
from engine.worker.kv_cache import DenseKVCache, KVCache, PackedKVCache
from engine.worker.lightning import LightningIndexer, quantize_keys
from engine.worker.rope import rotate_keys
from engine.worker.sparse_runtime import BoundsMirror, allocate_bounds
from sinkserve_kernels import block_sparse, torch_kernels
from sinkserve_kernels.backend import torch_backend
from sinkserve_kernels.indexed_sparse import IndexCache
from sinkserve_kernels.kv_quant import QuantKVCache

LAYERS, BLOCKS, B, H, D = 2, 8, 4, 2, 8
CPU = torch.device("cpu")


class Recorder:
    """A listener that records its calls (and the cache's keys of rotated blocks, to check the order)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_copy(self, src: list[int], dst: list[int]) -> None:
        self.calls.append(("copy", src, dst))

    def on_rotate(self, block_ids: list[int], cache: KVCache) -> None:
        self.calls.append(("rotate", block_ids, cache.gather(0, torch.tensor(block_ids), torch.float32)[0]))


def _inv_freqs() -> list[torch.Tensor]:
    return [1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))] * LAYERS


def _dense(seed: int = 0) -> DenseKVCache:
    cache = DenseKVCache.allocate(LAYERS, BLOCKS, B, H, D, torch.float32, CPU)
    g = torch.Generator().manual_seed(seed)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return cache


def _packed(seed: int = 0) -> PackedKVCache:
    """Blocks 1..4 packed from random 16-bit data, blocks 5..7 16-bit in slots 0..2 (block 0: the null block)."""
    fp_index = torch.full((BLOCKS,), -1, dtype=torch.int32)
    layers = [QuantKVCache.allocate(BLOCKS, 4, B, H, D, bits=8, group_size=4, dtype=torch.float32, fp_index=fp_index)
              for _ in range(LAYERS)]
    cache = PackedKVCache(layers, CPU, pack=torch_kernels.quantize_fp_slots)
    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        layer.fp_k.copy_(torch.randn(layer.fp_k.shape, generator=g))
        layer.fp_v.copy_(torch.randn(layer.fp_v.shape, generator=g))
    for block in (1, 2, 3, 4):  # pack through the side pool's slot 3, as the scheduler would
        cache.apply_precision_ops([("assign", block, 3)])
        for layer in layers:
            layer.fp_k[3] = torch.randn(layer.fp_k[3].shape, generator=g)
        cache.apply_precision_ops([("quantize", block, 3)])
    cache.apply_precision_ops([("assign", b, s) for s, b in enumerate((5, 6, 7))])
    return cache


def _snapshot(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.arange(BLOCKS)
    return [cache.gather(i, ids, torch.float32) for i in range(LAYERS)]


@pytest.mark.parametrize("make", [_dense, _packed], ids=["dense", "packed"])
def test_copy_writes_exactly_the_destination_blocks_and_tells_the_listeners(make) -> None:
    cache = make()
    rec = Recorder()
    cache.subscribe(rec)
    before = _snapshot(cache)
    copies = [(2, 3), (6, 7)]  # packed: a packed and a 16-bit block
    if cache.is_packed:
        cache.apply_precision_ops([("copy", a, b) for a, b in copies])
        assert [c[:3] for c in rec.calls] == [("copy", [2], [3]), ("copy", [6], [7])]
    else:
        cache.copy(copies)
        assert rec.calls == [("copy", [2, 6], [3, 7])]
    after = _snapshot(cache)
    for (k0, v0), (k1, v1) in zip(before, after):
        for b in range(BLOCKS):
            src = dict((d, s) for s, d in copies).get(b, b)
            assert torch.equal(k1[b], k0[src]) and torch.equal(v1[b], v0[src]), b


@pytest.mark.parametrize("make", [_dense, _packed], ids=["dense", "packed"])
def test_rotate_turns_exactly_the_named_keys_and_tells_the_listeners_after(make) -> None:
    cache = make()
    rec = Recorder()
    cache.subscribe(rec)
    before = _snapshot(cache)
    rotations = [(5, 5), (2, 3)]  # packed: a 16-bit block (5) and a packed one (2)
    cache.rotate(rotations, _inv_freqs())
    after = _snapshot(cache)
    shifts = dict(rotations)
    for (k0, v0), (k1, v1), inv in zip(before, after, _inv_freqs()):
        assert torch.equal(v1, v0)  # values carry no position
        for b in range(BLOCKS):
            if b not in shifts:
                assert torch.equal(k1[b], k0[b]), b
                continue
            want = rotate_keys(k0[b : b + 1], torch.tensor([shifts[b]]), inv)[0]
            tol = 0.05 if cache.is_packed and cache.fp_slot(b) < 0 else 1e-5  # a packed block is packed again
            assert torch.allclose(k1[b], want, atol=tol), b
            assert not torch.allclose(k1[b], k0[b], atol=tol), b
    [(op, ids, keys)] = rec.calls
    assert (op, ids) == ("rotate", sorted(shifts))
    assert torch.equal(keys, after[0][0][torch.tensor(ids)])  # the listener read the rotated keys


def test_no_op_steps_tell_nobody() -> None:
    cache = _dense()
    rec = Recorder()
    cache.subscribe(rec)
    cache.copy([])
    cache.rotate([], _inv_freqs())
    cache.apply_precision_ops([])
    assert rec.calls == []


def test_a_dense_cache_refuses_precision_ops() -> None:
    with pytest.raises(ValueError, match="dense"):
        _dense().apply_precision_ops([("quantize", 1, 0)])


def test_packed_precision_ops_pack_and_unpack_by_the_slot_map() -> None:
    cache = _packed()
    assert [cache.fp_slot(b) for b in range(BLOCKS)] == [-1, -1, -1, -1, -1, 0, 1, 2]
    fp_k = cache.layers[0].fp_k[1].clone()
    cache.apply_precision_ops([("quantize", 6, 1)])
    assert cache.fp_slot(6) == -1
    packed, _ = cache.gather(0, torch.tensor([6]), torch.float32)
    assert torch.allclose(packed[0], fp_k, atol=0.05) and not torch.equal(packed[0], fp_k)
    cache.apply_precision_ops([("dequantize", 6, 3)])
    assert cache.fp_slot(6) == 3
    assert torch.equal(cache.gather(0, torch.tensor([6]), torch.float32)[0], packed)
    with pytest.raises(ValueError, match="unknown KV op"):
        cache.apply_precision_ops([("evict", 1, 2)])


def test_nbytes_counts_every_pool_once() -> None:
    dense = _dense()
    assert dense.nbytes() == LAYERS * 2 * BLOCKS * B * H * D * 4
    packed = _packed()
    layer = packed.layers[0]
    per_layer = sum(t.numel() * t.element_size() for t in (layer.k_codes, layer.v_codes, layer.k_scale, layer.k_zero,
                                                           layer.v_scale, layer.v_zero, layer.fp_k, layer.fp_v))
    assert packed.nbytes() == LAYERS * per_layer


def _indexer(seed: int) -> IndexerState:
    g = torch.Generator().manual_seed(seed)
    heads, dim = 2, 4
    weights = LightningIndexer(wq=tuple(torch.randn(heads * dim, H * D, generator=g) for _ in range(LAYERS)),
                               wk=tuple(torch.randn(dim, H * D, generator=g) for _ in range(LAYERS)),
                               ww=tuple(torch.randn(heads, H * D, generator=g) for _ in range(LAYERS)),
                               heads=heads, dim=dim)
    return IndexerState(weights, [IndexCache.allocate(BLOCKS, B, dim, CPU) for _ in range(LAYERS)])


def _fill_mirrors(cache: KVCache, bounds: list, indexer: IndexerState) -> None:
    """Bounds and index keys of every block from its keys, as the attention writes keep them."""
    ids = torch.arange(BLOCKS)
    for i in range(LAYERS):
        keys, _ = cache.gather(i, ids, torch.float32)
        block_sparse.set_bounds(bounds[i], ids, keys)
        indexer.write(i, keys.reshape(-1, H, D), torch.arange(BLOCKS * B))


@pytest.mark.parametrize("make", [_dense, _packed], ids=["dense", "packed"])
def test_bounds_and_index_keys_follow_copies_and_rotations(make) -> None:
    cache = make()
    bounds = allocate_bounds(LAYERS, BLOCKS, H, D, torch.float32, CPU)
    indexer = _indexer(1)
    cache.subscribe(BoundsMirror(bounds))
    cache.subscribe(indexer)
    _fill_mirrors(cache, bounds, indexer)
    if cache.is_packed:
        cache.apply_precision_ops([("copy", 2, 3)])
    else:
        cache.copy([(2, 3)])
    cache.copy([(6, 7)])
    for i in range(LAYERS):
        for src, dst in ((2, 3), (6, 7)):
            assert torch.equal(bounds[i].packed[:, dst], bounds[i].packed[:, src])
            assert torch.equal(indexer.caches[i].keys[dst], indexer.caches[i].keys[src])
            assert torch.equal(indexer.caches[i].scale[dst], indexer.caches[i].scale[src])
    cache.rotate([(5, 7), (2, 2)], _inv_freqs())
    ids = torch.tensor([2, 5])
    for i in range(LAYERS):
        keys, _ = cache.gather(i, ids, torch.float32)
        want = allocate_bounds(1, BLOCKS, H, D, torch.float32, CPU)[0]
        block_sparse.set_bounds(want, ids, keys)
        assert torch.equal(bounds[i].packed[:, ids], want.packed[:, ids])
        codes, scale = quantize_keys(indexer.weights.keys(i, keys.reshape(-1, H, D)))
        assert torch.equal(indexer.caches[i].keys[ids], codes.view(2, B, -1))
        assert torch.equal(indexer.caches[i].scale[ids], scale.view(2, B))


def test_position_free_bounds_ignore_rotations() -> None:
    cache = _dense()
    bounds = allocate_bounds(LAYERS, BLOCKS, H, D, torch.float32, CPU)
    cache.subscribe(BoundsMirror(bounds, position_free=True))
    _fill_mirrors(cache, bounds, _indexer(1))
    before = [b.packed.clone() for b in bounds]
    cache.rotate([(3, 4)], _inv_freqs())
    assert all(torch.equal(b.packed, p) for b, p in zip(bounds, before))


@pytest.mark.parametrize("make", [_dense, _packed], ids=["dense", "packed"])
def test_write_then_attend_reads_the_new_tokens(make) -> None:
    cache = make()
    backend = torch_backend()
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(B, H, D, generator=g), torch.randn(B, H, D, generator=g)
    slots = torch.arange(5 * B, 6 * B)  # block 5: 16-bit in both layouts
    cache.write(backend, 1, k, v, slots)
    got_k, got_v = cache.gather(1, torch.tensor([5]), torch.float32)
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)
    # One query over that block alone: attention over exactly the written keys and values.
    q = torch.randn(1, H, D, generator=g)
    out = cache.paged_attention(backend, 1, q, torch.tensor([[5]], dtype=torch.int32), torch.tensor([B]),
                                torch.tensor([0, 1]), D ** -0.5)
    w = torch.softmax(torch.einsum("hd,bhd->hb", q[0], k) * D ** -0.5, dim=-1)
    assert torch.allclose(out.reshape(H, D), torch.einsum("hb,bhd->hd", w, v), atol=1e-5)


@pytest.mark.parametrize("make", [_dense, _packed], ids=["dense", "packed"])
def test_session_payload_of_a_block_loads_bit_for_bit_into_another_cache(make) -> None:
    src, dst = make(seed=0), make(seed=1)
    assert kv_block_codec.layout_digest(src, None) == kv_block_codec.layout_digest(dst, None)
    for block in (2, 6):  # packed: a packed block and a 16-bit one
        slot = src.fp_slot(block)
        data = kv_block_codec.read_block(src, block, slot, fp=slot >= 0)
        assert kv_block_codec.payload_is_fp(data) == (slot >= 0)
        kv_block_codec.write_block(dst, block, slot, data)
        for i in range(LAYERS):
            for a, b in zip(src.gather(i, torch.tensor([block]), torch.float32),
                            dst.gather(i, torch.tensor([block]), torch.float32)):
                assert torch.equal(a, b)
    assert kv_block_codec.layout_digest(_dense(), None) != kv_block_codec.layout_digest(_packed(), None)
