"""The model runner's paged KV cache as one object: a step's block operations are applied here, once.

Two layouts share one interface:

* ``DenseKVCache``: per layer ``(k, v)`` tensors ``[num_blocks, block_size, Hkv, D]`` in the model dtype.
* ``PackedKVCache``: per layer a ``sinkserve_kernels.kv_quant.QuantKVCache`` (packed codes + a 16-bit side
  pool), all layers sharing one block -> side-pool slot map (``fp_index``).

One object holds every layer, not one object per layer: a block id names the same block in every layer, the
block manager's operations (copy, rotate, pack) are per block id, and the packed layout's slot map is shared,
so an operation is one call that walks the layers, and a listener subscribes once.

Block operations (``copy``, ``rotate``, and for the packed layout ``apply_precision_ops``) notify the
``BlockListener`` s subscribed to the cache (the sparse block bounds, the trained indexer's key caches) after
the K/V changed, so what lives beside each block follows it without a second copy of the step's op loop::

    runner.execute(inp)
      cache.apply_precision_ops(inp.kv_ops)   ("copy", a, b)  -> listeners.on_copy([a], [b])
      cache.copy(inp.copies)                                  -> listeners.on_copy(src, dst)
      cache.rotate(inp.rotations, inv_freqs)                  -> listeners.on_rotate(sorted block ids, cache)

The attention function writes and attends through ``write`` and ``paged_attention``, which pick the
backend's dense or packed entry point; ``layers`` is what the kernels take (a ``(k, v)`` tuple or a
``QuantKVCache`` per layer), their argument lists unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from engine.worker.rope import rotate_keys
from sinkserve_kernels import block_sparse
from sinkserve_kernels.backend import AttentionBackend


class BlockListener(Protocol):
    """Storage kept per block id beside K/V, told of each block operation after the K/V changed."""

    def on_copy(self, src: list[int], dst: list[int]) -> None:
        """Block ``src[i]`` was copied to ``dst[i]``, in list order (a chain sees its predecessors)."""

    def on_rotate(self, block_ids: list[int], cache: "KVCache") -> None:
        """The keys of ``block_ids`` (sorted, distinct) were rotated; read the new keys from ``cache``."""


class KVCache(ABC):
    """All layers' paged K/V of one rank, and the block operations a step applies to them."""

    is_packed = False
    # The precisions a block's payload can have (``block_tensors``' ``fp``): 16-bit only, unless packed.
    payload_precisions: tuple[bool, ...] = (True,)

    def __init__(self, layers: list, device: torch.device) -> None:
        self.layers = layers
        self.device = device
        self._listeners: list[BlockListener] = []

    def subscribe(self, listener: BlockListener) -> None:
        """Have ``listener`` follow every later copy and rotation."""
        self._listeners.append(listener)

    @property
    @abstractmethod
    def block_size(self) -> int:
        ...

    def nbytes(self) -> int:
        """Bytes of K/V storage (every layer, every pool; not the int32/int64 slot maps and channel indices)."""
        seen: set[int] = set()  # the packed layers share fp_index (excluded anyway); count each tensor once
        total = 0
        for layer in self.layers:
            for t in self._tensors(layer):
                if id(t) not in seen and t.dtype not in (torch.int32, torch.int64):
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    @abstractmethod
    def block_tensors(self, layer: int, block: int, slot: int, fp: bool) -> list[torch.Tensor]:
        """The views of ``layer`` that hold ``block`` (``slot``: its 16-bit side-pool slot when ``fp``), in the
        session KV payload's order (``engine/memory/kv_block_codec.py``)."""

    @abstractmethod
    def write(self, backend: AttentionBackend, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """New tokens' keys and values ``[T, Hkv, D]`` into their slots of ``layer`` (< 0: not stored)."""

    @abstractmethod
    def paged_attention(self, backend: AttentionBackend, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        **kw: object) -> torch.Tensor:
        """``backend``'s paged attention of ``query [T, Hq, D]`` over ``layer`` (``kw``: window, sinks, plan)."""

    def gather(self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, block_size, Hkv, D]`` of blocks of ``layer`` in ``dtype`` (packed ones decoded)."""
        return block_sparse.gather_blocks(self.layers[layer], block_ids, dtype)

    def fp_slot(self, block: int) -> int:
        """The 16-bit slot ``block`` reads (``-1``: packed); a dense cache's blocks are all 16-bit (0)."""
        return 0

    def copy(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``a`` to block ``b`` for each ``(a, b)``, then tell the listeners."""
        if not copies:
            return
        self._copy(copies)
        src, dst = [a for a, _ in copies], [b for _, b in copies]
        for listener in self._listeners:
            listener.on_copy(src, dst)

    def rotate(self, rotations: Sequence[tuple[int, int]], inv_freqs: Sequence[torch.Tensor]) -> None:
        """Retention: rotate the keys of each ``(block, shift)`` by ``shift`` positions with the layer's RoPE
        table (``inv_freqs[layer]``), then tell the listeners which blocks changed."""
        if not rotations:
            return
        self._rotate(rotations, inv_freqs)
        ids = sorted({b for b, _ in rotations})
        for listener in self._listeners:
            listener.on_rotate(ids, self)

    def apply_precision_ops(self, ops: Sequence[tuple[str, int, int]]) -> None:
        """The block manager's precision log (``engine/memory/block_manager.py``); a dense cache has none."""
        if ops:
            raise ValueError(f"a dense KV cache has no precision ops, got {ops[0][0]!r}")

    def _ids(self, values: Iterable[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    @abstractmethod
    def _tensors(self, layer: object) -> list[torch.Tensor]:
        ...

    @abstractmethod
    def _copy(self, copies: Sequence[tuple[int, int]]) -> None:
        ...

    @abstractmethod
    def _rotate(self, rotations: Sequence[tuple[int, int]], inv_freqs: Sequence[torch.Tensor]) -> None:
        ...


class DenseKVCache(KVCache):
    """Per layer ``(k_cache, v_cache)`` tensors ``[num_blocks, block_size, Hkv, D]``."""

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "DenseKVCache":
        """Zeroed K and V for every layer."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls([(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                    for _ in range(num_layers)], device)

    @property
    def block_size(self) -> int:
        return int(self.layers[0][0].shape[1])

    def block_tensors(self, layer: int, block: int, slot: int, fp: bool) -> list[torch.Tensor]:
        k_cache, v_cache = self.layers[layer]
        return [k_cache[block], v_cache[block]]

    def write(self, backend: AttentionBackend, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = self.layers[layer]
        backend.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(self, backend: AttentionBackend, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        **kw: object) -> torch.Tensor:
        k_cache, v_cache = self.layers[layer]
        return backend.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **kw)

    def _tensors(self, layer: object) -> list[torch.Tensor]:
        return list(layer)  # type: ignore[call-overload]

    def _copy(self, copies: Sequence[tuple[int, int]]) -> None:
        src, dst = self._ids(a for a, _ in copies), self._ids(b for _, b in copies)
        for k_cache, v_cache in self.layers:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _rotate(self, rotations: Sequence[tuple[int, int]], inv_freqs: Sequence[torch.Tensor]) -> None:
        blocks, shifts = self._ids(b for b, _ in rotations), self._ids(s for _, s in rotations)
        for (k_cache, _), inv_freq in zip(self.layers, inv_freqs):
            k_cache[blocks] = rotate_keys(k_cache[blocks], shifts, inv_freq)


class PackedKVCache(KVCache):
    """Per layer a ``QuantKVCache``; every layer shares ``fp_index``. ``pack`` is the backend's
    ``quantize_blocks(cache, block_ids, fp_slots)`` (the device's kernel)."""

    is_packed = True
    payload_precisions = (False, True)

    def __init__(self, layers: list, device: torch.device, pack: Callable[..., None]) -> None:
        super().__init__(layers, device)
        self._pack = pack

    @property
    def fp_index(self) -> torch.Tensor:
        """``int32 [num_blocks]``: each block's 16-bit slot, ``-1`` for a packed block (shared by every layer)."""
        return self.layers[0].fp_index

    @property
    def block_size(self) -> int:
        return int(self.layers[0].block_size)

    def fp_slot(self, block: int) -> int:
        return int(self.fp_index[block])

    def block_tensors(self, layer: int, block: int, slot: int, fp: bool) -> list[torch.Tensor]:
        cache = self.layers[layer]
        if fp:
            return [cache.fp_k[slot], cache.fp_v[slot]]
        out = [cache.k_codes[block], cache.v_codes[block], cache.k_scale[block], cache.k_zero[block],
               cache.v_scale[block], cache.v_zero[block]]
        if cache.k_outlier is not None:
            out.append(cache.k_outlier[block])
        return out

    def write(self, backend: AttentionBackend, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        backend.write_kv_quant(key, value, self.layers[layer], slot_mapping)

    def paged_attention(self, backend: AttentionBackend, layer: int, query: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        **kw: object) -> torch.Tensor:
        return backend.paged_attention_quant(query, self.layers[layer], block_tables, seq_lens, query_start_loc, scale,
                                             **kw)

    def _tensors(self, layer: object) -> list[torch.Tensor]:
        return [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]

    def apply_precision_ops(self, ops: Sequence[tuple[str, int, int]]) -> None:
        """Mirror the block manager's precision changes, in its order: ``("assign", block, slot)``,
        ``("quantize", block, slot)`` (pack; consecutive packs batched), ``("dequantize", block, slot)`` and
        ``("copy", src, dst)`` (the listeners follow each copy)."""
        fp_index = self.fp_index
        pending: list[tuple[int, int]] = []

        def flush() -> None:
            if pending:
                self.pack([b for b, _ in pending], [f for _, f in pending])
                pending.clear()

        for op, a, b in ops:
            if op == "quantize":
                pending.append((a, b))
                continue
            flush()
            if op == "assign":
                fp_index[a] = b
            elif op == "dequantize":
                self._dequantize(a, b)
            elif op == "copy":
                self.copy([(a, b)])
            else:
                raise ValueError(f"unknown KV op {op!r}")
        flush()

    def pack(self, block_ids: Sequence[int], fp_slots: Sequence[int]) -> None:
        """Pack the 16-bit slots ``fp_slots`` into ``block_ids`` on every layer; the blocks then read packed."""
        blocks, slots = self._ids(block_ids), self._ids(fp_slots)
        for cache in self.layers:
            self._pack(cache, blocks, slots)
        self.fp_index[blocks] = -1

    def _dequantize(self, block: int, slot: int) -> None:
        from sinkserve_kernels import torch_kernels

        idx = self._ids([block])
        for cache in self.layers:
            k, v = torch_kernels.dequantize_blocks(cache, idx)
            cache.fp_k[slot] = k[0].to(cache.fp_k.dtype)
            cache.fp_v[slot] = v[0].to(cache.fp_v.dtype)
        self.fp_index[block] = slot

    def _copy(self, copies: Sequence[tuple[int, int]]) -> None:
        for src, dst in copies:  # in order: a chain of copies must see its predecessors
            fs, fd = self.fp_slot(src), self.fp_slot(dst)
            for cache in self.layers:
                if fs >= 0 and fd >= 0:
                    cache.fp_k[fd] = cache.fp_k[fs]
                    cache.fp_v[fd] = cache.fp_v[fs]
                for t in (cache.k_codes, cache.v_codes, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
                          cache.k_outlier):
                    if t is not None:
                        t[dst] = t[src]

    def _rotate(self, rotations: Sequence[tuple[int, int]], inv_freqs: Sequence[torch.Tensor]) -> None:
        """16-bit blocks rotate in the side pool (the scheduler promotes a packed block to 16-bit before its
        first rotation). Only when no slot was free is a packed key block dequantized, rotated in float32 and
        packed again with fresh per-channel scales (RoPE mixes channel c with c + D/2, so a rotation cannot
        be applied to codes)."""
        from sinkserve_kernels import torch_kernels

        slots = [self.fp_slot(b) for b, _ in rotations]
        fp_rot = [(s, sh) for (_, sh), s in zip(rotations, slots) if s >= 0]
        q_rot = [(b, sh) for (b, sh), s in zip(rotations, slots) if s < 0]
        for cache, inv_freq in zip(self.layers, inv_freqs):
            if fp_rot:
                idx, shifts = self._ids(s for s, _ in fp_rot), self._ids(sh for _, sh in fp_rot)
                cache.fp_k[idx] = rotate_keys(cache.fp_k[idx], shifts, inv_freq)
            if q_rot:
                idx, shifts = self._ids(b for b, _ in q_rot), self._ids(sh for _, sh in q_rot)
                k, _ = torch_kernels.dequantize_blocks(cache, idx)
                torch_kernels.requantize_keys(cache, idx, rotate_keys(k, shifts, inv_freq))
