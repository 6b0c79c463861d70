"""Quantized paged KV: int8 / packed-int4 blocks with 16-bit protected blocks, and attention that dequantizes
inside the kernel.

Layout (one layer; ``NB`` blocks, ``B`` tokens per block, ``H`` KV heads, ``D`` head dim, ``G`` value group)::

    block id space (what block tables hold) = 0..NB-1, block 0 = null block
                                   fp_index[NB] int32
      block_tables[s] = [ 5 | 9 | 0 | 2 | 7 ]        -1  -> block lives in the quantized pool
                          |   |       |   |          >=0 -> block lives in the 16-bit pool at that index
    fp_index  ...  [5]=0  [9]=-1  [2]=-1  [7]=1      (sinks / anchors / residual window: 16-bit)

    quantized pool (per block b, per head h)                      16-bit pool (per fp block f)
    +--------------------------------------------------------+    +-------------------------------+
    | k_codes [b, 0..B-1, h, :]   uint8  B x D*bits/8 bytes   |    | fp_k [f, 0..B-1, h, 0..D-1]   |
    | v_codes [b, 0..B-1, h, :]   uint8  B x D*bits/8 bytes   |    | fp_v [f, 0..B-1, h, 0..D-1]   |
    | k_scale, k_zero [b, h, 0..D-1]      fp16  per CHANNEL   |    |   bf16/fp16, 2 x B*H*D*2 bytes |
    |   (one pair per channel over the block's B tokens)     |    +-------------------------------+
    | v_scale, v_zero [b, 0..B-1, h, 0..D/G-1] fp16 per TOKEN |
    |   (one pair per token per G consecutive channels)      |
    +--------------------------------------------------------+

    int4 packing (byte c of a token-head row, c in [0, D/2)):   bits 7..4 = channel c + D/2
                                                                 bits 3..0 = channel c
    (pairs channel c with c + D/2 so kernels dequantize two half-tiles without an interleave)

Dequantization is asymmetric: ``x = code * scale + zero`` with ``code in [0, 2^bits - 1]`` and ``zero`` the
group minimum. Keys are quantized per channel (KIVI: key outliers live in fixed channels), values per token.

Bytes per quantized block (all heads)::

    codes   = 2 * B * H * D * bits / 8
    k scale = 2 * H * D * 2                 (scale + zero, fp16)
    v scale = 2 * B * H * (D / G) * 2       (scale + zero, fp16)

    e.g. B=16, H=8, D=128, G=32:  int8 32768 + 4096 + 2048 = 38912 B   (59% of bf16's 65536 B)
                                  int4 16384 + 4096 + 2048 = 22528 B   (34% of bf16)
    per-channel key scales cost 2*2*8/B bits per key value: 2 bits at B=16, 0.5 bits at B=64.

Every block id owns quantized storage (so the block manager keeps one id space); a block that is 16-bit
also holds a slot of the (small) 16-bit pool. Tokens are written 16-bit first (``write_kv_fp``) and a block
is quantized when it leaves the residual window (``quantize_fp_blocks``), or directly from new tokens when a
whole block of a long prefill is already outside it (``quantize_write_kv``) — quantize-on-write: a block is
quantized exactly once, when it becomes immutable, because per-channel key scales need all ``B`` tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sinkserve_kernels._triton import check_device, next_pow2, tl, triton
from sinkserve_kernels.paged_attention import KVSource, launch_paged_attention, write_kv

logger = logging.getLogger(__name__)


def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, bits: int, group_size: int) -> int:
    """Bytes one quantized block (keys + values, all heads, codes + scales) occupies — the layout arithmetic."""
    codes = 2 * block_size * num_kv_heads * head_dim * bits // 8
    k_scales = 2 * num_kv_heads * head_dim * 2
    v_scales = 2 * block_size * num_kv_heads * (head_dim // group_size) * 2
    return codes + k_scales + v_scales


@dataclass
class QuantKVCache:
    """One layer's quantized paged KV cache (see the module docstring for the layout)."""

    bits: int
    group_size: int
    k_codes: torch.Tensor  # uint8 [NB, B, H, D * bits / 8]
    v_codes: torch.Tensor
    k_scale: torch.Tensor  # fp16 [NB, H, D]
    k_zero: torch.Tensor
    v_scale: torch.Tensor  # fp16 [NB, B, H, D / G]
    v_zero: torch.Tensor
    fp_k: torch.Tensor  # 16-bit [NF, B, H, D]
    fp_v: torch.Tensor
    fp_index: torch.Tensor  # int32 [NB], -1 = quantized
    # Outlier key channels kept 16-bit (torch reference path only): per KV head the O channel indices
    # [1, H, O] (long) and, per block, their 16-bit values [NB, B, H, O]. None: no outlier channels.
    outlier_idx: torch.Tensor | None = None
    k_outlier: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        num_fp_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int = 8,
        group_size: int = 32,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        outlier_channels: int = 0,
        fp_index: torch.Tensor | None = None,
    ) -> "QuantKVCache":
        """Allocate an empty cache; every block starts quantized (``fp_index == -1``).

        ``bits`` 2 (four codes a byte, ``torch_kernels.pack_codes``) is read by the torch reference only, as are
        ``outlier_channels`` (their indices start as channels ``0..O-1``; the engine calibrates them).
        ``fp_index`` may be passed to share one block -> 16-bit slot map between the layers of a model.
        """
        if bits not in (8, 4, 2):
            raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
        if block_size & (block_size - 1):
            raise ValueError(f"quantized blocks need a power-of-two block_size, got {block_size}")
        if head_dim % 2 or (head_dim // 2) % group_size or group_size & (group_size - 1):
            # Value groups must not straddle the two half-tiles the kernels work on.
            raise ValueError(f"group_size {group_size} must be a power of two dividing head_dim/2 ({head_dim // 2})")
        nb, b, h, d = num_blocks, block_size, num_kv_heads, head_dim
        cb = d * bits // 8
        u8 = dict(dtype=torch.uint8, device=device)
        f16 = dict(dtype=torch.float16, device=device)
        return cls(
            bits=bits,
            group_size=group_size,
            k_codes=torch.zeros(nb, b, h, cb, **u8),
            v_codes=torch.zeros(nb, b, h, cb, **u8),
            k_scale=torch.zeros(nb, h, d, **f16),
            k_zero=torch.zeros(nb, h, d, **f16),
            v_scale=torch.zeros(nb, b, h, d // group_size, **f16),
            v_zero=torch.zeros(nb, b, h, d // group_size, **f16),
            fp_k=torch.zeros(num_fp_blocks, b, h, d, dtype=dtype, device=device),
            fp_v=torch.zeros(num_fp_blocks, b, h, d, dtype=dtype, device=device),
            fp_index=fp_index if fp_index is not None else torch.full((nb,), -1, dtype=torch.int32, device=device),
            outlier_idx=torch.arange(outlier_channels, device=device).repeat(1, h, 1) if outlier_channels else None,
            k_outlier=torch.zeros(nb, b, h, outlier_channels, dtype=dtype, device=device) if outlier_channels else None,
        )

    @property
    def num_blocks(self) -> int:
        return int(self.k_codes.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k_codes.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_codes.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k_scale.shape[2])

    def quantized_bytes_per_block(self) -> int:
        """Bytes the allocated tensors spend per quantized block (must equal ``bytes_per_block``)."""
        per_block = [self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero]
        if self.k_outlier is not None:
            per_block.append(self.k_outlier)
        total = sum(t.numel() * t.element_size() for t in per_block)
        return total // self.num_blocks

    def source(self) -> KVSource:
        """View for the attention kernels."""
        return KVSource(
            self.k_codes, self.v_codes, self.block_size, self.num_kv_heads, self.head_dim, self.bits,
            self.fp_k, self.fp_v, self.fp_index, self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.group_size,
        )  # fmt: skip


@triton.jit
def _quantize_kernel(
    src_k_ptr,
    src_v_ptr,
    src_row_ptr,
    dst_block_ptr,
    k_codes_ptr,
    v_codes_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    NGH: tl.constexpr,
    BITS: tl.constexpr,
):
    """One program = one block x one KV head: quantize ``BLOCK_SIZE`` source tokens into block ``dst``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    src_row = tl.load(src_row_ptr + i).to(tl.int64)  # first token row of the block in the source
    dst = tl.load(dst_block_ptr + i).to(tl.int64)
    QMAX: tl.constexpr = (1 << BITS) - 1
    HD2: tl.constexpr = HEAD_DIM // 2
    t = tl.arange(0, BLOCK_SIZE)
    c = tl.arange(0, HD2)
    src = ((src_row + t) * NUM_KV_HEADS + h) * HEAD_DIM

    # Keys: per channel over the block's tokens.
    k_lo = tl.load(src_k_ptr + src[:, None] + c[None, :]).to(tl.float32)
    k_hi = tl.load(src_k_ptr + src[:, None] + HD2 + c[None, :]).to(tl.float32)
    # Scale and zero are rounded to their fp16 storage *before* computing codes so the codes match what
    # the dequantizer will multiply by.
    kmin_lo = tl.min(k_lo, 0).to(tl.float16).to(tl.float32)
    kmin_hi = tl.min(k_hi, 0).to(tl.float16).to(tl.float32)
    ks_lo = ((tl.max(k_lo, 0) - kmin_lo) / QMAX).to(tl.float16).to(tl.float32)
    ks_hi = ((tl.max(k_hi, 0) - kmin_hi) / QMAX).to(tl.float16).to(tl.float32)
    kc_lo = tl.floor((k_lo - kmin_lo[None, :]) / tl.where(ks_lo > 0, ks_lo, 1.0)[None, :] + 0.5)
    kc_hi = tl.floor((k_hi - kmin_hi[None, :]) / tl.where(ks_hi > 0, ks_hi, 1.0)[None, :] + 0.5)
    kc_lo = tl.minimum(tl.maximum(kc_lo, 0.0), QMAX).to(tl.int32)
    kc_hi = tl.minimum(tl.maximum(kc_hi, 0.0), QMAX).to(tl.int32)
    srow = (dst * NUM_KV_HEADS + h) * HEAD_DIM
    tl.store(ks_ptr + srow + c, ks_lo.to(tl.float16))
    tl.store(ks_ptr + srow + HD2 + c, ks_hi.to(tl.float16))
    tl.store(kz_ptr + srow + c, kmin_lo.to(tl.float16))
    tl.store(kz_ptr + srow + HD2 + c, kmin_hi.to(tl.float16))

    # Values: per token per GROUP_SIZE channels, handled as [B, groups, G] tiles.
    g = tl.arange(0, NGH)
    e = tl.arange(0, GROUP_SIZE)
    ch = g[None, :, None] * GROUP_SIZE + e[None, None, :]
    v_lo = tl.load(src_v_ptr + src[:, None, None] + ch).to(tl.float32)
    v_hi = tl.load(src_v_ptr + src[:, None, None] + HD2 + ch).to(tl.float32)
    vmin_lo = tl.min(v_lo, 2).to(tl.float16).to(tl.float32)
    vmin_hi = tl.min(v_hi, 2).to(tl.float16).to(tl.float32)
    vs_lo = ((tl.max(v_lo, 2) - vmin_lo) / QMAX).to(tl.float16).to(tl.float32)
    vs_hi = ((tl.max(v_hi, 2) - vmin_hi) / QMAX).to(tl.float16).to(tl.float32)
    vc_lo = tl.floor((v_lo - vmin_lo[:, :, None]) / tl.where(vs_lo > 0, vs_lo, 1.0)[:, :, None] + 0.5)
    vc_hi = tl.floor((v_hi - vmin_hi[:, :, None]) / tl.where(vs_hi > 0, vs_hi, 1.0)[:, :, None] + 0.5)
    vc_lo = tl.minimum(tl.maximum(vc_lo, 0.0), QMAX).to(tl.int32)
    vc_hi = tl.minimum(tl.maximum(vc_hi, 0.0), QMAX).to(tl.int32)
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    vrow = ((dst * BLOCK_SIZE + t) * NUM_KV_HEADS + h) * NG
    tl.store(vs_ptr + vrow[:, None] + g[None, :], vs_lo.to(tl.float16))
    tl.store(vs_ptr + vrow[:, None] + NGH + g[None, :], vs_hi.to(tl.float16))
    tl.store(vz_ptr + vrow[:, None] + g[None, :], vmin_lo.to(tl.float16))
    tl.store(vz_ptr + vrow[:, None] + NGH + g[None, :], vmin_hi.to(tl.float16))

    if BITS == 8:
        drow = ((dst * BLOCK_SIZE + t) * NUM_KV_HEADS + h) * HEAD_DIM
        tl.store(k_codes_ptr + drow[:, None] + c[None, :], kc_lo.to(tl.uint8))
        tl.store(k_codes_ptr + drow[:, None] + HD2 + c[None, :], kc_hi.to(tl.uint8))
        tl.store(v_codes_ptr + drow[:, None, None] + ch, vc_lo.to(tl.uint8))
        tl.store(v_codes_ptr + drow[:, None, None] + HD2 + ch, vc_hi.to(tl.uint8))
    else:
        prow = ((dst * BLOCK_SIZE + t) * NUM_KV_HEADS + h) * HD2
        tl.store(k_codes_ptr + prow[:, None] + c[None, :], (kc_lo | (kc_hi << 4)).to(tl.uint8))
        tl.store(v_codes_ptr + prow[:, None, None] + ch, (vc_lo | (vc_hi << 4)).to(tl.uint8))


def _launch_quantize(
    src_k: torch.Tensor, src_v: torch.Tensor, src_rows: torch.Tensor, cache: QuantKVCache, block_ids: torch.Tensor
) -> None:
    n = int(block_ids.shape[0])
    if n == 0:
        return
    if cache.bits not in (8, 4) or cache.outlier_idx is not None:
        raise ValueError("the Triton kernels read int8 / int4 without outlier channels; int2 and outlier "
                         "channels run on the torch reference (sinkserve_kernels.torch_kernels)")
    check_device(src_k, cache.k_codes)
    d, g = cache.head_dim, cache.group_size
    if d // 2 != next_pow2(d // 2):
        raise ValueError(f"quantized KV needs head_dim/2 to be a power of two, got head_dim={d}")
    _quantize_kernel[(n, cache.num_kv_heads)](
        src_k, src_v, src_rows.to(torch.int64), block_ids.to(torch.int64),
        cache.k_codes, cache.v_codes, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
        NUM_KV_HEADS=cache.num_kv_heads, HEAD_DIM=d, BLOCK_SIZE=cache.block_size, GROUP_SIZE=g,
        NGH=(d // 2) // g, BITS=cache.bits,
    )  # fmt: skip
    # The block now reads from the quantized pool.
    cache.fp_index[block_ids.long()] = -1


def quantize_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: QuantKVCache,
    block_ids: torch.Tensor,
    token_starts: torch.Tensor,
) -> None:
    """Quantize whole blocks of new tokens straight into the quantized pool (quantize-on-write).

    ``key/value [T, H, D]`` (contiguous); block ``block_ids[i]`` receives tokens
    ``token_starts[i] .. token_starts[i] + block_size - 1``. The blocks are marked quantized.
    """
    key, value = key.contiguous(), value.contiguous()
    _launch_quantize(key, value, token_starts, cache, block_ids)


def quantize_fp_blocks(cache: QuantKVCache, block_ids: torch.Tensor) -> None:
    """Quantize 16-bit-resident blocks (e.g. leaving the residual window) and mark them quantized.

    The caller frees their 16-bit pool slots afterwards (it knows which; this stays sync-free).
    """
    rows = cache.fp_index[block_ids.long()].long() * cache.block_size
    _launch_quantize(cache.fp_k, cache.fp_v, rows, cache, block_ids)


def quantize_fp_slots(cache: QuantKVCache, block_ids: torch.Tensor, fp_slots: torch.Tensor) -> None:
    """Like ``quantize_fp_blocks`` with the 16-bit slots given (``fp_index`` may be shared by layers and
    already updated by an earlier layer); the engine's entry point (``AttentionBackend.quantize_blocks``)."""
    _launch_quantize(cache.fp_k, cache.fp_v, fp_slots.long() * cache.block_size, cache, block_ids)


def write_kv_fp(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens (flat slots in the block id space) into their 16-bit-resident blocks.

    Tokens whose block is quantized (or slot < 0) are skipped: quantized blocks are immutable and are
    written whole by ``quantize_write_kv``.
    """
    b = cache.block_size
    slots = slot_mapping.long()
    blk = torch.where(slots >= 0, slots // b, 0)
    fp = cache.fp_index[blk].long()
    fp_slots = torch.where((slots >= 0) & (fp >= 0), fp * b + slots % b, -1)
    write_kv(key, value, cache.fp_k, cache.fp_v, fp_slots)


def paged_attention_quant(
    query: torch.Tensor,
    cache: QuantKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` over a quantized cache: codes are dequantized in registers, 16-bit blocks read as
    is (``window``, ``sinks`` as in ``sinkserve_kernels.torch_kernels.paged_attention``)."""
    return launch_paged_attention(
        query, cache.source(), block_tables, seq_lens, query_start_loc, scale, num_splits, out, window, sinks
    )
