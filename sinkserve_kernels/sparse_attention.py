"""Sparse attention over selected cache slots (output of ``sinkserve_kernels.topk``), 16-bit or quantized KV.

Each query token attends only to its ``K`` selected flat slots ``block_id * block_size + offset``
(``-1`` = padding). Causality, null blocks and the forced set are already encoded in the selection, so
the kernel is a plain online-softmax over gathered rows. GQA: one program owns one token x one KV head
and all ``Hq / Hkv`` query heads of the group, so each gathered key row is read once per group. With
quantized KV (``sinkserve_kernels.kv_quant.QuantKVCache``) rows are dequantized in registers, and blocks flagged
16-bit (sinks, anchors, residual window) are read from the 16-bit pool in the same pass.

Split-K: decode of a single sequence has only ``Hkv`` programs; ``num_splits`` cuts the ``K`` selected
slots into segments reduced by ``paged_attention._reduce_kernel``. ``NUM_SPLITS`` is a compile-time
constant, so the launcher picks it from ``SPARSE_SPLIT_CHOICES`` only (powers of two up to 32), and the
engine's start-up warm-up (``warm_up_sparse``) compiles each: a batch size or a selection width never
compiles a new variant mid-serving. Worked example on 132 SMs, one decode token, 8 KV heads, 2,048
selected slots: 8 programs -> ceil(264 / 8) = 33 wanted, at most 2,048 // 256 = 8 -> 8 splits; with 3
tokens (24 programs): ceil(264 / 24) = 11, rounded down to 8.
"""

from __future__ import annotations

import logging

import torch

from sinkserve_kernels._triton import PER_STEP_INTS, cast_out, check_device, dot_precision, interpreting, load_kv, mma, next_pow2, tl, triton
from sinkserve_kernels.kv_quant import QuantKVCache
from sinkserve_kernels.paged_attention import (LOG2E, SPLIT_CHOICES, KernelConfig, KVSource, _num_sms, paged_options, plain_source,
                                     pow2_floor, reduce_splits, split_buffers)

logger = logging.getLogger(__name__)


@triton.jit(do_not_specialize=PER_STEP_INTS["sparse_attention"])
def _sparse_attn_kernel(
    q_ptr,
    o_ptr,
    part_o_ptr,
    part_ml_ptr,
    slots_ptr,
    k_ptr,
    v_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_index_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    num_selected,
    qk_scale,
    stride_st,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    offs = tl.arange(0, HALF)
    HD2: tl.constexpr = HEAD_DIM // 2
    dmask = offs < HD2
    qm = row_ok[:, None] & dmask[None, :]
    q_row = tok * stride_qt + head * stride_qh
    q_lo = tl.load(q_ptr + q_row[:, None] + offs[None, :], mask=qm, other=0.0)
    q_hi = tl.load(q_ptr + q_row[:, None] + HD2 + offs[None, :], mask=qm, other=0.0)

    seg = tl.cdiv(tl.cdiv(num_selected, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * seg
    hi = tl.minimum(lo + seg, num_selected)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + tok * stride_st + j, mask=j < hi, other=-1)
        ok = slots >= 0
        k_lo, k_hi, v_lo, v_hi = load_kv(
            tl.maximum(slots, 0), ok, kv_head, k_ptr, v_ptr, fpk_ptr, fpv_ptr, fp_index_ptr, ks_ptr, kz_ptr, vs_ptr,
            vz_ptr, NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_SIZE, GROUP_SIZE, QUANT,
        )
        s = mma(q_lo, tl.trans(k_lo), q_lo.dtype, DOT_PREC, INTERP)
        s += mma(q_hi, tl.trans(k_hi), q_lo.dtype, DOT_PREC, INTERP)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_lo = acc_lo * alpha[:, None] + mma(p, v_lo, q_lo.dtype, DOT_PREC, INTERP)
        acc_hi = acc_hi * alpha[:, None] + mma(p, v_hi, q_lo.dtype, DOT_PREC, INTERP)
        m_i = m_new

    om = row_ok[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)  # a row with nothing selected returns zeros
        o_row = tok * stride_ot + head * stride_oh
        odt = o_ptr.dtype.element_ty
        tl.store(o_ptr + o_row[:, None] + offs[None, :], cast_out(acc_lo * inv[:, None], odt, INTERP), mask=om)
        tl.store(o_ptr + o_row[:, None] + HD2 + offs[None, :], cast_out(acc_hi * inv[:, None], odt, INTERP), mask=om)
    else:
        pr = (tok * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + pr[:, None] * HEAD_DIM + offs[None, :], acc_lo, mask=om)
        tl.store(part_o_ptr + pr[:, None] * HEAD_DIM + HD2 + offs[None, :], acc_hi, mask=om)
        tl.store(part_ml_ptr + pr * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + pr * 2 + 1, l_i, mask=row_ok)


def sparse_constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_splits: int,
                      dtype: torch.dtype, interp: bool, quant: int = 0, group_size: int = 1) -> dict:
    """The compile-time arguments of ``_sparse_attn_kernel`` for one launch. Its launch options are the paged
    kernel's (``paged_options``: the same tiles, so the same warps, and fewer pipelining stages for float32
    over packed KV, whose three stages took 411 KB of sm_90 shared memory at head_dim 256)."""
    group = num_q_heads // num_kv_heads
    return dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_M=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, HALF=max(16, next_pow2(head_dim // 2)), BLOCK_SIZE=block_size,
        BLOCK_N=32 if interp else 64, NUM_SPLITS=num_splits, QUANT=quant, GROUP_SIZE=group_size,
        DOT_PREC=dot_precision(dtype), INTERP=interp,
    )  # fmt: skip


def _launch(
    query: torch.Tensor,
    kv: KVSource,
    slots: torch.Tensor,
    scale: float,
    num_splits: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    check_device(query, kv.k, slots)
    num_tokens, hq, d = query.shape
    if d != kv.head_dim or hq % kv.num_kv_heads:
        raise ValueError(f"query [{num_tokens}, {hq}, {d}] does not match cache heads {kv.num_kv_heads} x {kv.head_dim}")
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if slots.stride(-1) != 1:
        slots = slots.contiguous()
    num_selected = int(slots.shape[1])
    if num_splits is None:
        num_splits = choose_sparse_splits(num_tokens, kv.num_kv_heads, num_selected, query.device)
    part_o, part_ml = split_buffers(out, num_splits)
    consts = sparse_constexprs(hq, kv.num_kv_heads, d, kv.block_size, num_splits, query.dtype, interpreting(),
                               kv.quant, kv.group_size)
    _sparse_attn_kernel[(num_tokens, kv.num_kv_heads, num_splits)](
        query, out, part_o, part_ml, slots, *kv.pointers(), num_selected, scale * LOG2E, slots.stride(0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), **consts, **paged_options(consts),
    )  # fmt: skip
    reduce_splits(part_o, part_ml, out, num_splits)
    return out


SPARSE_MAX_SPLITS = 32
SPARSE_SPLIT_CHOICES = tuple(s for s in SPLIT_CHOICES if s <= SPARSE_MAX_SPLITS)


def choose_sparse_splits(num_tokens: int, num_kv_heads: int, num_selected: int, device: torch.device) -> int:
    """Split the selected slots when (tokens x KV heads) programs cannot fill the GPU: about two programs per
    SM, each split keeping >= 256 slots. Shapes only (no sync); always one of ``SPARSE_SPLIT_CHOICES``."""
    if interpreting() or device.type != "cuda":
        return 1
    programs = num_tokens * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return pow2_floor(min(-(-2 * sms // programs), num_selected // 256, SPARSE_MAX_SPLITS))


def sparse_launch_configs(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          interp: bool = False, quant: int = 0, group_size: int = 1) -> list[KernelConfig]:
    """Every ``_sparse_attn_kernel`` variant the launcher can pick for one model shape and KV storage (one per
    split count; the split reductions are ``paged_attention.engine_launch_configs``' ``reduce`` variants)."""
    out = []
    for splits in SPARSE_SPLIT_CHOICES:
        c = sparse_constexprs(num_q_heads, num_kv_heads, head_dim, block_size, splits, dtype, interp, quant,
                              group_size if quant else 1)
        out.append(KernelConfig("sparse_attention", tuple(c.items()), num_splits=splits, options=tuple(paged_options(c).items())))
    return out


def warm_up_sparse(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, force: bool = False, quant: int = 0, group_size: int = 1) -> int:
    """Launch every ``sparse_launch_configs`` variant once, through the real launchers, on a two-block cache
    (CUDA only; ``force``: tests drive it under the interpreter). Returns the launches made. Varying
    integers (the selection width, its stride) are not specialized (``PER_STEP_INTS``), so one launch per
    split count covers every step."""
    if device.type != "cuda" and not force:
        return 0
    query = torch.zeros(1, num_q_heads, head_dim, dtype=dtype, device=device)
    slots = torch.arange(2 * block_size, dtype=torch.int32, device=device)[None] + block_size  # blocks 1 and 2
    if quant:
        from sinkserve_kernels import kv_quant

        cache = kv_quant.QuantKVCache.allocate(4, 4, block_size, num_kv_heads, head_dim, bits=quant,
                                               group_size=group_size, dtype=dtype, device=device)
        cache.fp_index[2] = 2  # block 1 packed, block 2 in the 16-bit pool: both read paths compile
    else:
        k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    for cfg in sparse_launch_configs(num_q_heads, num_kv_heads, head_dim, block_size, dtype, interpreting(), quant,
                                     group_size):
        if quant:
            sparse_attention_quant(query, cache, slots, 1.0, num_splits=cfg.num_splits)
        else:
            sparse_attention(query, k_cache, k_cache, slots, 1.0, num_splits=cfg.num_splits)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(SPARSE_SPLIT_CHOICES)


def sparse_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` over its selected ``slots [T, K]`` of 16-bit paged caches.

    Same semantics as ``torch_kernels.sparse_attention``; ``out`` (optional, like ``query``) receives the result.
    """
    return _launch(query, plain_source(k_cache, v_cache), slots, scale, num_splits, out)


def sparse_attention_quant(
    query: torch.Tensor,
    cache: QuantKVCache,
    slots: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attention`` over a quantized cache (codes dequantized in registers, 16-bit blocks as is)."""
    return _launch(query, cache.source(), slots, scale, num_splits, out)
