"""The model runner's side of sparse attention: block bounds storage and upkeep, and a step's plan.

The bounds (``sinkserve_kernels.block_sparse.BlockBounds``, one per layer) share the KV cache's block ids, so they
follow their blocks through every block operation of a step (``BoundsMirror``, subscribed to the runner's
``engine.worker.kv_cache.KVCache``): the packed cache's ``copy`` ops and copy-on-write copies copy them;
retention's rotations change the keys, so the rotated blocks' bounds are recomputed from the rotated keys;
evicted or freed blocks need nothing (the next owner's first write, at offset 0, resets them); prefix-cache
sharing reads the same block id, hence the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.worker.kv_cache import KVCache
from sinkserve_kernels import block_sparse


def allocate_bounds(num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> list[block_sparse.BlockBounds]:
    """Zeroed bounds for every layer (``2 * Hkv * D`` values per block and layer: ``2 / block_size`` of
    the block's 16-bit K/V)."""
    return [block_sparse.BlockBounds.allocate(num_blocks, num_kv_heads, head_dim, dtype, device)
            for _ in range(num_layers)]


@dataclass(frozen=True)
class BoundsMirror:
    """Keeps the bounds with their blocks (an ``engine.worker.kv_cache.BlockListener``): copies copy them,
    rotations recompute them from the rotated keys. ``position_free``: the bounds hold pre-RoPE keys
    (selected memory), which rotations do not change."""

    bounds: list[block_sparse.BlockBounds]
    position_free: bool = False

    def on_copy(self, src: list[int], dst: list[int]) -> None:
        device = self.bounds[0].packed.device
        s = torch.tensor(src, dtype=torch.long, device=device)
        d = torch.tensor(dst, dtype=torch.long, device=device)
        for layer in self.bounds:  # in order: a chain of copies must see its predecessors (rare; loop is cheap)
            for i in range(len(src)):
                block_sparse.copy_bounds(layer, s[i : i + 1], d[i : i + 1])

    def on_rotate(self, block_ids: list[int], cache: KVCache) -> None:
        if self.position_free:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        for i, layer in enumerate(self.bounds):
            keys, _ = cache.gather(i, ids, torch.float32)
            block_sparse.set_bounds(layer, ids, keys)


def plan(sparse_forced: list[list[int] | None], config: EngineConfig, table_width: int,
         device: torch.device) -> block_sparse.SparsePlan | None:
    """The step's selection rules, or None when every sequence attends densely (the plain paged path)."""
    if not sparse_forced or all(f is None for f in sparse_forced):
        return None
    # Built where it is read, from the (few) forced entries: a host-built [S, W] mask would be host work and a
    # transfer that grow with the table width, i.e. with the context.
    forced = torch.zeros(len(sparse_forced), table_width, dtype=torch.bool, device=device)
    top = []
    rows: list[int] = []
    cols: list[int] = []
    for i, blocks in enumerate(sparse_forced):
        if blocks is None:
            top.append(-1)
            continue
        top.append(config.sparse.top_blocks(config.block_size))
        ids = [b for b in blocks if b < table_width]
        rows += [i] * len(ids)
        cols += ids
    if rows:
        forced[torch.tensor(rows, dtype=torch.long).to(device), torch.tensor(cols, dtype=torch.long).to(device)] = True
    return block_sparse.SparsePlan(forced, top, config.sparse.local_window,
                                   prefill_group=config.sparse.prefill_group, top_tokens=config.sparse.top_k)
