"""One KV block of a model runner's caches as bytes, and back, bit for bit (session KV, ``engine/memory/session_cache.py``).

A payload is ``MAGIC``, one precision byte and the block's tensors of every layer, raw, in a fixed order::

    b"SKV1" b"q"  layer 0: k_codes v_codes k_scale k_zero v_scale v_zero [k_outlier]   layer 1: ...
    b"SKV1" b"f"  layer 0: fp_k fp_v (the 16-bit side pool slot; the model dtype)      layer 1: ...
    (a cache that is not quantized: b"f" with each layer's K and V block)

Shapes and dtypes come from the destination caches, so a payload only loads into a runner of the same
KV layout (``kv_layout``); a size mismatch raises instead of loading garbage.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

MAGIC = b"SKV1"


def _block_tensors(cache: Any, block: int, slot: int, fp: bool) -> list[torch.Tensor]:
    """The views of one layer that hold ``block`` (``slot``: its 16-bit side-pool slot when ``fp``)."""
    if isinstance(cache, tuple):  # not quantized: (K, V) [NB, B, H, D]
        return [cache[0][block], cache[1][block]]
    if fp:
        return [cache.fp_k[slot], cache.fp_v[slot]]
    out = [cache.k_codes[block], cache.v_codes[block], cache.k_scale[block], cache.k_zero[block],
           cache.v_scale[block], cache.v_zero[block]]
    if cache.k_outlier is not None:
        out.append(cache.k_outlier[block])
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def read_block(caches: list, block: int, slot: int, fp: bool) -> bytes:
    """The payload of ``block`` (16-bit in ``slot`` when ``fp``)."""
    parts = [MAGIC, b"f" if fp else b"q"]
    for cache in caches:
        parts.extend(_bytes(t) for t in _block_tensors(cache, block, slot, fp))
    return b"".join(parts)


def payload_is_fp(data: bytes) -> bool:
    """Whether a payload holds a 16-bit block (raises on a payload that is not one)."""
    if data[:4] != MAGIC or data[4:5] not in (b"f", b"q"):
        raise ValueError("not a session KV block payload")
    return data[4:5] == b"f"


def write_block(caches: list, block: int, slot: int, data: bytes) -> None:
    """Load a payload into ``block`` (its 16-bit data into side-pool ``slot`` when the payload is 16-bit)."""
    fp = payload_is_fp(data)
    views = [t for cache in caches for t in _block_tensors(cache, block, slot, fp)]
    expected = 5 + sum(t.numel() * t.element_size() for t in views)
    if len(data) != expected:
        raise ValueError(f"session KV block payload has {len(data)} bytes, this KV layout needs {expected}")
    at = 5
    for t in views:
        n = t.numel() * t.element_size()
        src = torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8).view(t.dtype).view(t.shape)
        t.copy_(src.to(t.device))
        at += n


def layout_digest(caches: list, outlier_idx: list | None) -> str:
    """Shapes and dtypes of one block's tensors (and the calibrated outlier channels), hashed: two
    runners whose digests agree read each other's payloads the same way."""
    h = hashlib.sha256()
    for cache in caches[:1]:
        for fp in (False, True) if not isinstance(cache, tuple) else (True,):
            for t in _block_tensors(cache, 0, 0, fp):
                h.update(f"{tuple(t.shape)}{t.dtype};".encode())
    h.update(f"layers={len(caches)};".encode())
    for idx in outlier_idx or ():
        h.update(_bytes(idx.to(torch.int64)))
    return h.hexdigest()[:16]
