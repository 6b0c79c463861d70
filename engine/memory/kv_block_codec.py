"""One KV block of a model runner's caches as bytes, and back, bit for bit (session KV, ``engine/memory/session_cache.py``).

A payload is ``MAGIC``, one precision byte and the block's tensors of every layer, raw, in a fixed order::

    b"SKV1" b"q"  layer 0: k_codes v_codes k_scale k_zero v_scale v_zero [k_outlier]   layer 1: ...
    b"SKV1" b"f"  layer 0: fp_k fp_v (the 16-bit side pool slot; the model dtype)      layer 1: ...
    (a cache that is not quantized: b"f" with each layer's K and V block)

The tensors of a block are the cache's (``engine.worker.kv_cache.KVCache.block_tensors``: a dense cache's K and
V, a packed cache's codes and scales or its side-pool slot). Shapes and dtypes come from the destination
cache, so a payload only loads into a runner of the same KV layout (``kv_layout``); a size mismatch raises
instead of loading garbage.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

MAGIC = b"SKV1"


def _views(cache: Any, block: int, slot: int, fp: bool) -> list[torch.Tensor]:
    """Every layer's views of ``block``, layer by layer (``cache``: an ``engine.worker.kv_cache.KVCache``)."""
    return [t for layer in range(len(cache.layers)) for t in cache.block_tensors(layer, block, slot, fp)]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def read_block(cache: Any, block: int, slot: int, fp: bool) -> bytes:
    """The payload of ``block`` of ``cache`` (an ``engine.worker.kv_cache.KVCache``; 16-bit in ``slot`` when ``fp``)."""
    return b"".join([MAGIC, b"f" if fp else b"q", *(_bytes(t) for t in _views(cache, block, slot, fp))])


def payload_is_fp(data: bytes) -> bool:
    """Whether a payload holds a 16-bit block (raises on a payload that is not one)."""
    if data[:4] != MAGIC or data[4:5] not in (b"f", b"q"):
        raise ValueError("not a session KV block payload")
    return data[4:5] == b"f"


def write_block(cache: Any, block: int, slot: int, data: bytes) -> None:
    """Load a payload into ``block`` of ``cache`` (its 16-bit data into side-pool ``slot`` when the payload is
    16-bit)."""
    views = _views(cache, block, slot, payload_is_fp(data))
    expected = 5 + sum(t.numel() * t.element_size() for t in views)
    if len(data) != expected:
        raise ValueError(f"session KV block payload has {len(data)} bytes, this KV layout needs {expected}")
    at = 5
    for t in views:
        n = t.numel() * t.element_size()
        src = torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8).view(t.dtype).view(t.shape)
        t.copy_(src.to(t.device))
        at += n


def layout_digest(cache: Any, outlier_idx: list | None) -> str:
    """Shapes and dtypes of one block's tensors (and the calibrated outlier channels), hashed: two
    runners whose digests agree read each other's payloads the same way."""
    h = hashlib.sha256()
    for fp in cache.payload_precisions:
        for t in cache.block_tensors(0, 0, 0, fp):
            h.update(f"{tuple(t.shape)}{t.dtype};".encode())
    h.update(f"layers={len(cache.layers)};".encode())
    for idx in outlier_idx or ():
        h.update(_bytes(idx.to(torch.int64)))
    return h.hexdigest()[:16]
