"""The model runner's side of the trained lightning indexer: its weights, its paged index-key caches
(one per layer, int8 + per-token scale, same block ids as K/V), and their upkeep through block ops.

The index key of a token is ``Wk . k`` of the layer's own key (``engine/worker/lightning.py``), written by the
attention function whenever K/V is written (prefill and decode). Block ops mirror the block bounds'
(``engine/worker/sparse_runtime.py``): copies copy the index keys; retention's RoPE rotations change the keys,
so rotated blocks' index keys are recomputed from the rotated keys; evicted or freed blocks need nothing
(the next owner overwrites every slot it uses before any query can see it); prefix-cache sharing reads
the same block id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.worker.lightning import LightningIndexer, quantize_keys
from engine.worker.sparse_config import INDEXER_WEIGHTS
from sinkserve_kernels import block_sparse
from sinkserve_kernels.indexed_sparse import IndexCache

logger = logging.getLogger(__name__)


@dataclass
class IndexerState:
    """Trained indexer weights and the per-layer index-key caches."""

    weights: LightningIndexer
    caches: list[IndexCache]

    def write(self, layer: int, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Index keys of new keys ``[T, Hkv, D]`` into their slots."""
        codes, scale = quantize_keys(self.weights.keys(layer, key))
        self.caches[layer].write(codes, scale, slot_mapping)

    def queries(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weights.queries(layer, q)


def load_weights(model_dir: str, num_layers: int, world_size: int, device: torch.device) -> LightningIndexer:
    """``<model>/indexer.safetensors``; ``ConfigError`` naming ``sparse.indexer`` when missing, of another
    depth, or under tensor parallelism (an index key reads every KV head of the layer)."""
    if world_size > 1:
        raise ConfigError("sparse.indexer", "'trained' reads all KV heads of a layer; not supported with "
                          f"tensor_parallel_size {world_size} (use 'block_bounds')")
    weights = LightningIndexer.load(Path(model_dir) / INDEXER_WEIGHTS, num_layers).to(device)
    logger.info("trained lightning indexer: %d layers x %d heads x %d dims (int8 index keys)", weights.num_layers,
                weights.heads, weights.dim)
    return weights


def allocate(weights: LightningIndexer, num_blocks: int, block_size: int, device: torch.device) -> IndexerState:
    return IndexerState(weights, [IndexCache.allocate(num_blocks, block_size, weights.dim, device)
                                  for _ in range(weights.num_layers)])


def apply_block_ops(state: IndexerState, kv_caches: list, inp, device: torch.device) -> None:
    """Mirror a step's block copies and rotations (``ModelInput``; already applied to the K/V)."""
    copies = [(a, b) for op, a, b in inp.kv_ops if op == "copy"] + list(inp.copies)
    for a, b in copies:  # in order: a chain of copies must see its predecessors
        src = torch.tensor([a], dtype=torch.long, device=device)
        dst = torch.tensor([b], dtype=torch.long, device=device)
        for cache in state.caches:
            cache.copy(src, dst)
    if inp.rotations:
        ids = torch.tensor(sorted({b for b, _ in inp.rotations}), dtype=torch.long, device=device)
        for layer, (cache, kv) in enumerate(zip(state.caches, kv_caches)):
            keys, _ = block_sparse.gather_blocks(kv, ids, torch.float32)  # [n, B, Hkv, D]
            n, bsz = keys.shape[:2]
            codes, scale = quantize_keys(state.weights.keys(layer, keys.reshape(n * bsz, *keys.shape[2:])))
            cache.keys[ids] = codes.view(n, bsz, -1)
            cache.scale[ids] = scale.view(n, bsz)
