"""The model runner's side of the trained lightning indexer: its weights, its paged index-key caches
(one per layer, int8 + per-token scale, same block ids as K/V), and their upkeep through block ops.

The index key of a token is ``Wk . k`` of the layer's own key (``engine/worker/lightning.py``), written by the
attention function whenever K/V is written (prefill and decode). ``IndexerState`` subscribes to the runner's
``engine.worker.kv_cache.KVCache`` as the block bounds do (``engine/worker/sparse_runtime.py``): copies copy
the index keys; retention's RoPE rotations change the keys, so rotated blocks' index keys are recomputed from
the rotated keys; evicted or freed blocks need nothing (the next owner overwrites every slot it uses before
any query can see it); prefix-cache sharing reads the same block id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.worker.kv_cache import KVCache
from engine.worker.lightning import LightningIndexer, quantize_keys
from engine.worker.sparse_config import INDEXER_WEIGHTS
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

    def on_copy(self, src: list[int], dst: list[int]) -> None:
        """``engine.worker.kv_cache.BlockListener``: the copied blocks' index keys follow them."""
        device = self.caches[0].keys.device
        for a, b in zip(src, dst):  # in order: a chain of copies must see its predecessors
            s = torch.tensor([a], dtype=torch.long, device=device)
            d = torch.tensor([b], dtype=torch.long, device=device)
            for cache in self.caches:
                cache.copy(s, d)

    def on_rotate(self, block_ids: list[int], kv: KVCache) -> None:
        """``engine.worker.kv_cache.BlockListener``: index keys of the rotated blocks, from their new keys."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
        for layer, cache in enumerate(self.caches):
            keys, _ = kv.gather(layer, ids, torch.float32)  # [n, B, Hkv, D]
            n, bsz = keys.shape[:2]
            codes, scale = quantize_keys(self.weights.keys(layer, keys.reshape(n * bsz, *keys.shape[2:])))
            cache.keys[ids] = codes.view(n, bsz, -1)
            cache.scale[ids] = scale.view(n, bsz)


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
