"""Decode attention over a packed KV cache on the torch path (CPU): each sequence's keys are gathered
*split by precision* once per step, so a layer decodes only the packed blocks and copies the 16-bit ones.
This is the ``torch`` backend's path and the reference of the ``cpu`` backend's C kernel
(``sinkserve_kernels/csrc/decode_attention.c``, whose core reads the codes in place and is what ``auto`` runs on CPU).

A decode step's compact gather (``torch_kernels.Gather``) mixes both kinds of block in logical order, and
dequantizing it whole decodes the 16-bit blocks' stale codes too, then overwrites them (a scatter). Key
order does not matter to a single-token query (RoPE is already in the keys; the mask says what is
visible), so this module reorders each sequence's blocks: its packed blocks first, then its 16-bit ones,
each part padded to the widest sequence's count::

    sequence 0: logical blocks [ 7 (16-bit: sinks) | 12 (packed) | 3 (packed) | 9 (16-bit: residual) ]
    sequence 1: logical blocks [ 5 (16-bit) | 8 (16-bit) ]

    packed part, Wp = 2          16-bit part, Wf = 2 (pool slots)
    [ 12 | 3 ]                   [ slot(7) | slot(9) ]
    [ 0  | 0 ]  (masked)         [ slot(5) | slot(8) ]

    per layer:  keys [S, Wp + Wf, B, Hkv, D] = [ dequantize(packed part) | fp_k[slots] ]  -> SDPA

The split (``SplitGather``) depends on the step's block tables and the shared ``fp_index`` only, so it is
built once per step and reused by every layer (``split_gather`` memoises it on the step's plan). What a
layer writes lands in reused workspace buffers (``sinkserve_kernels/workspace.py``): on CPU a fresh multi-MiB tensor
page-faults in on first touch, which cost more than the decoding.

Equal to ``paged_attention`` on the dequantized cache within float rounding (the same dequantization,
``dequantize_packed_into``, and the same SDPA; ``tests/kernels/test_packed_decode.py``).
``bench/kv_decode_variants.py`` keeps the alternative that was measured against this one (scales folded
into the query and the softmax weights, no dequantized K/V: fewer bytes, ~4x the torch ops per layer,
slower here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sinkserve_kernels.layout import NULL_BLOCK
from sinkserve_kernels.workspace import workspace

if TYPE_CHECKING:
    from sinkserve_kernels.kv_quant import QuantKVCache
    from sinkserve_kernels.torch_kernels import Gather


def unpack_codes_into(pool: torch.Tensor, ids: torch.Tensor, bits: int, out: torch.Tensor, name: str) -> None:
    """Codes of blocks ``ids`` of ``pool [NB, B, H, D * bits / 8]`` unpacked into the float tensor ``out``
    (any strides, shape ``[..., D]`` with the leading dims covering ``len(ids) x B x H``), without scales.

    The ``P = 8 / bits`` codes of a byte are channels ``c + j * D / P`` (``torch_kernels.pack_codes``), so
    part ``j`` of every byte fills the channel slice ``j * D/P : (j + 1) * D/P`` of ``out``.
    """
    n = int(ids.numel())
    ws = workspace()
    packed_shape = (*out.shape[:-1], pool.shape[-1])
    packed = torch.index_select(pool, 0, ids, out=ws.get(name + "_codes", (n, *pool.shape[1:]), torch.uint8,
                                                            pool.device)).view(packed_shape)
    if bits == 8:
        out.copy_(packed)
        return
    parts, width, mask = 8 // bits, pool.shape[-1], (1 << bits) - 1
    part = ws.get(name + "_part", packed_shape, torch.uint8, pool.device)
    for j in range(parts):
        if j == 0:
            torch.bitwise_and(packed, mask, out=part)
        else:
            torch.bitwise_right_shift(packed, bits * j, out=part)
            if j < parts - 1:
                part.bitwise_and_(mask)
        out[..., j * width : (j + 1) * width].copy_(part)


@dataclass(frozen=True)
class SplitGather:
    """One decode group's keys split by precision (see the module docstring): ``S`` rows, each its packed
    blocks (``packed [S * Wp]`` block ids, null where a row has fewer) then its 16-bit blocks (``slots
    [S * Wf]`` side-pool slots, 0 where a row has fewer), and the visible keys ``mask [S, 1, 1, (Wp + Wf) * B]``
    in that order."""

    rows: int
    packed: torch.Tensor
    wp: int
    slots: torch.Tensor
    wf: int
    mask: torch.Tensor


def _part(blocks: torch.Tensor, keep: torch.Tensor, key_mask: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The ``keep`` blocks of each row moved to the front (logical order), the width, and their key mask."""
    width = int(keep.sum(dim=1).max()) if keep.numel() else 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    kept = keep.gather(1, order)
    ids = torch.where(kept, blocks.gather(1, order), NULL_BLOCK)
    b = key_mask.shape[-1]
    mask = key_mask.gather(1, order[..., None].expand(-1, -1, b)) & kept[..., None]
    return ids, width, mask


def build_split_gather(g: "Gather", mask: torch.Tensor, fp_index: torch.Tensor, block_size: int) -> SplitGather:
    """The ``SplitGather`` of a decode gather ``g`` with visible keys ``mask [S, 1, 1, W * B]`` under
    ``fp_index`` (block -> 16-bit slot, -1 packed)."""
    s_rows, w = g.rows, g.width
    blocks = g.blocks.view(s_rows, w)
    key_mask = mask.reshape(s_rows, w, block_size)
    slot = fp_index.index_select(0, g.blocks).view(s_rows, w).long()
    live = blocks != NULL_BLOCK
    is_fp = live & (slot >= 0)
    packed, wp, p_mask = _part(blocks, live & ~is_fp, key_mask)
    fp_blocks, wf, f_mask = _part(blocks, is_fp, key_mask)
    slots = fp_index.index_select(0, fp_blocks.flatten()).long().clamp_min(0)
    full = torch.cat([p_mask, f_mask], dim=1).view(s_rows, 1, 1, (wp + wf) * block_size)
    return SplitGather(s_rows, packed.flatten(), wp, slots, wf, full)


def split_gather(plan: object, g: "Gather", mask: torch.Tensor, cache: "QuantKVCache") -> SplitGather:
    """``build_split_gather`` memoised per (plan, ``fp_index``): every layer of a step shares one plan and,
    in the engine, one ``fp_index``, which no layer changes. The memo holds the plan itself, so a later
    step's plan can never be mistaken for it; ``fp_index``'s version counter guards in-place changes
    between calls with one plan (tests)."""
    try:
        version = cache.fp_index._version
    except RuntimeError:  # an inference tensor has no version counter: build every time
        return build_split_gather(g, mask, cache.fp_index, cache.block_size)
    ws = workspace()
    memo = ws.memo
    for entry in memo:
        if entry[0] is plan and entry[1] is g and entry[2] is cache.fp_index and entry[3] == version:
            return entry[4]
    sg = build_split_gather(g, mask, cache.fp_index, cache.block_size)
    memo.insert(0, (plan, g, cache.fp_index, version, sg))
    del memo[4:]  # one per sliding-window width of the model is enough
    return sg


def dequantize_packed_into(cache: "QuantKVCache", ids: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """Dequantize packed blocks ``ids`` into ``out_k, out_v [..., B, H, D]`` (any float dtype; the leading
    dims, which may be strided, cover ``len(ids)``): the codes are unpacked straight into the output
    (``unpack_codes_into``, one conversion pass), then ``code * scale + zero`` is applied in
    place against scales broadcast over the block's tokens (keys) or the group's channels (values). (A
    mixed-dtype ``addcmul(zero, uint8 codes, scale)`` over the same broadcast was measured ~40x slower on
    CPU.) A non-float32 output is computed in float32 and rounded once."""
    n = int(ids.numel())
    if n == 0:
        return
    if out_k.dtype is not torch.float32:
        k32 = torch.empty(out_k.shape, dtype=torch.float32, device=out_k.device)
        v32 = torch.empty(out_v.shape, dtype=torch.float32, device=out_v.device)
        dequantize_packed_into(cache, ids, k32, v32)
        out_k.copy_(k32)
        out_v.copy_(v32)
        return
    b, h, d, g = cache.block_size, cache.num_kv_heads, cache.head_dim, cache.group_size
    lead = tuple(out_k.shape[:-3])
    unpack_codes_into(cache.k_codes, ids, cache.bits, out_k, "deq_k")
    out_k.mul_(cache.k_scale.index_select(0, ids).float().view(*lead, 1, h, d))
    out_k.add_(cache.k_zero.index_select(0, ids).float().view(*lead, 1, h, d))
    unpack_codes_into(cache.v_codes, ids, cache.bits, out_v, "deq_v")
    v6 = out_v.unflatten(-1, (d // g, g))
    v6.mul_(cache.v_scale.index_select(0, ids).float().view(*lead, b, h, d // g, 1))
    v6.add_(cache.v_zero.index_select(0, ids).float().view(*lead, b, h, d // g, 1))
    if cache.outlier_idx is not None:
        o = cache.outlier_idx.shape[-1]
        idx = cache.outlier_idx.view(*(1,) * len(lead), 1, h, o).expand(*lead, b, h, o)
        out_k.scatter_(-1, idx, cache.k_outlier.index_select(0, ids).view(*lead, b, h, o).to(out_k.dtype))


def decode_keys_values(cache: "QuantKVCache", sg: SplitGather, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[S, (Wp + Wf) * B, Hkv, D]`` of a ``SplitGather`` in ``dtype``: the packed part
    dequantized, the 16-bit part copied from the side pool (workspace buffers: valid until the next call)."""
    ws = workspace()
    s_rows, b, h, d = sg.rows, cache.block_size, cache.num_kv_heads, cache.head_dim
    dev = cache.k_codes.device
    keys = ws.get("pd_k", (s_rows, sg.wp + sg.wf, b, h, d), dtype, dev)
    values = ws.get("pd_v", (s_rows, sg.wp + sg.wf, b, h, d), dtype, dev)
    if sg.wp:
        dequantize_packed_into(cache, sg.packed, keys[:, : sg.wp], values[:, : sg.wp])
    if sg.wf:
        shape = (s_rows, sg.wf, b, h, d)
        keys[:, sg.wp :] = cache.fp_k.flatten(1).index_select(0, sg.slots).view(shape)
        values[:, sg.wp :] = cache.fp_v.flatten(1).index_select(0, sg.slots).view(shape)
    length = (sg.wp + sg.wf) * b
    return keys.view(s_rows, length, h, d), values.view(s_rows, length, h, d)
