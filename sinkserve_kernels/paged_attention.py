"""Triton paged attention over ragged batches, plus a Triton ``write_kv``.

Same signatures and semantics as ``sinkserve_kernels.torch_kernels.paged_attention`` / ``write_kv``:

* queries of all sequences are packed on one token axis; ``query_start_loc`` marks the sequences;
* keys/values are read through ``block_tables`` from ``[num_blocks, block_size, Hkv, D]`` caches;
  block id 0 (the null block) is skipped;
* causal inside the new chunk: query ``i`` of a sequence sits at position ``seq_len - q_len + i``;
* GQA of any ratio: one program owns one KV head and *all* of its query heads, so every key tile is
  loaded once per group instead of once per query head;
* a sliding-window layer (``window``) sees keys ``q - window < k <= q``; the key loop starts at the
  window of the tile's first query, so such a layer reads ``O(window)`` keys per tile, not the history;
* learned sinks (``sinks [Hq]``, gpt-oss) start the online softmax at ``(m, l) = (sink, 1)``: one extra
  term in the denominator with no value (the split path adds it in the reduction instead).

Work decomposition. One program = (query tile, KV head, KV split). A query tile is up to ``BLOCK_Q``
consecutive query tokens of one sequence times the ``G = Hq / Hkv`` heads of the group, flattened into
``BLOCK_M = BLOCK_Q * G`` rows, so decode tokens (``BLOCK_Q = 1``) still fill a tensor-core tile with
their query heads. The kernel streams the sequence's KV in ``BLOCK_N`` tiles with an online softmax.

Split-KV. A single long decode has only ``Hkv`` programs, far fewer than the GPU's SMs. With
``num_splits > 1`` each program covers one contiguous segment of the keys and writes an unnormalized
partial output with its running max and sum; ``_reduce_kernel`` merges the segments
(``o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``). The split count is chosen on the host from
shapes only (no device sync), so the call stays CUDA-graph friendly.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from sinkserve_kernels._triton import (
    cast_out,
    check_device,
    dot_precision,
    find_seq,
    interpreting,
    load_kv,
    mma,
    next_pow2,
    tl,
    triton,
    PER_STEP_INTS,
)

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
# ``window`` passed to the kernel for a full-attention layer: larger than any position.
NO_WINDOW = 1 << 30


@dataclass(frozen=True)
class KVSource:
    """Where a kernel reads KV from: a plain 16-bit cache (``quant == 0``) or a quantized cache.

    For ``quant in (8, 4)`` ``k/v`` hold the codes and the other tensors are the side pool, the per-block
    indirection into it and the scales (see ``sinkserve_kernels.kv_quant.QuantKVCache``).
    """

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    num_kv_heads: int
    head_dim: int
    quant: int = 0
    fp_k: torch.Tensor | None = None
    fp_v: torch.Tensor | None = None
    fp_index: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    group_size: int = 1

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The 11 tensors ``load_kv`` takes; unused ones alias ``k`` (never read when ``quant == 0``)."""
        k = self.k
        return (
            self.k,
            self.v,
            self.fp_k if self.fp_k is not None else k,
            self.fp_v if self.fp_v is not None else k,
            self.fp_index if self.fp_index is not None else k,
            self.k_scale if self.k_scale is not None else k,
            self.k_zero if self.k_zero is not None else k,
            self.v_scale if self.v_scale is not None else k,
            self.v_zero if self.v_zero is not None else k,
        )


def plain_source(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVSource:
    """A ``KVSource`` over 16/32-bit caches ``[num_blocks, block_size, Hkv, D]``."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        # Kernels compute flat offsets from the shape; a strided view would be read wrongly.
        raise ValueError("KV caches must be contiguous")
    _, block_size, hkv, d = k_cache.shape
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    return KVSource(k_cache, v_cache, block_size, hkv, d)


@triton.jit(do_not_specialize=PER_STEP_INTS["paged_attention"])
def _paged_attn_kernel(
    q_ptr,
    o_ptr,
    part_o_ptr,
    part_ml_ptr,
    k_ptr,
    v_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_index_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    block_tables_ptr,
    stride_bt,
    seq_lens_ptr,
    qsl_ptr,
    sinks_ptr,
    num_seqs,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # logical position of this sequence's first query

        rows = tl.arange(0, BLOCK_M)
        q_local = q_tile * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows // GROUP < BLOCK_Q) & (q_local < q_len)
        q_pos = ctx + q_local
        tok = (q_start + q_local).to(tl.int64)

        offs = tl.arange(0, HALF)
        HD2: tl.constexpr = HEAD_DIM // 2
        dmask = offs < HD2
        qm = row_ok[:, None] & dmask[None, :]
        q_row = tok * stride_qt + head * stride_qh
        q_lo = tl.load(q_ptr + q_row[:, None] + offs[None, :], mask=qm, other=0.0)
        q_hi = tl.load(q_ptr + q_row[:, None] + HD2 + offs[None, :], mask=qm, other=0.0)

        # Keys this tile can see: positions [window start of its first query, its last query position].
        kv_end = ctx + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
        kv_start = tl.maximum(ctx + q_tile * BLOCK_Q - window + 1, 0)
        if NUM_SPLITS == 1:
            lo = kv_start
            hi = kv_end
        else:
            seg = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = kv_start + split * seg
            hi = tl.minimum(lo + seg, kv_end)

        if HAS_SINKS and NUM_SPLITS == 1:
            # The sink is one more softmax term with no value: start from it (log2 domain, like s).
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            in_range = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_range, other=0)
            kv_ok = in_range & (blk != 0)  # null block: evicted span, never attended
            slots = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            k_lo, k_hi, v_lo, v_hi = load_kv(
                slots, kv_ok, kv_head, k_ptr, v_ptr, fpk_ptr, fpv_ptr, fp_index_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_SIZE, GROUP_SIZE, QUANT,
            )
            s = mma(q_lo, tl.trans(k_lo), q_lo.dtype, DOT_PREC, INTERP)
            s += mma(q_hi, tl.trans(k_hi), q_lo.dtype, DOT_PREC, INTERP)
            s = s * qk_scale  # log2 domain: qk_scale = scale * log2(e)
            ok = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen no valid key yet keep m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc_lo = acc_lo * alpha[:, None] + mma(p, v_lo, q_lo.dtype, DOT_PREC, INTERP)
            acc_hi = acc_hi * alpha[:, None] + mma(p, v_hi, q_lo.dtype, DOT_PREC, INTERP)
            m_i = m_new

        if NUM_SPLITS == 1:
            # A query with no visible key (its whole past evicted) gets 0 rather than NaN.
            inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
            o_row = tok * stride_ot + head * stride_oh
            om = row_ok[:, None] & dmask[None, :]
            odt = o_ptr.dtype.element_ty
            tl.store(o_ptr + o_row[:, None] + offs[None, :], cast_out(acc_lo * inv[:, None], odt, INTERP), mask=om)
            tl.store(o_ptr + o_row[:, None] + HD2 + offs[None, :], cast_out(acc_hi * inv[:, None], odt, INTERP), mask=om)
        else:
            # Partials: [T, Hq, NUM_SPLITS, D] unnormalized accumulators and [T, Hq, NUM_SPLITS, 2] (m, l).
            pr = (tok * NUM_Q_HEADS + head) * NUM_SPLITS + split
            om = row_ok[:, None] & dmask[None, :]
            tl.store(part_o_ptr + pr[:, None] * HEAD_DIM + offs[None, :], acc_lo, mask=om)
            tl.store(part_o_ptr + pr[:, None] * HEAD_DIM + HD2 + offs[None, :], acc_hi, mask=om)
            tl.store(part_ml_ptr + pr * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + pr * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_kernel(
    part_o_ptr,
    part_ml_ptr,
    o_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    INTERP: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    sm = sp < NUM_SPLITS
    base = (tok * NUM_Q_HEADS + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sm, other=float("-inf"))
    l = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=sm, other=0.0)
    acc = tl.load(
        part_o_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :], mask=sm[:, None] & (d[None, :] < HEAD_DIM), other=0.0
    )
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 domain, like the partial maxima
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # segments that saw no key have m = -inf -> weight 0
    den = tl.sum(w * l, 0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_max)
    num = tl.sum(w[:, None] * acc, 0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + d, cast_out(out, o_ptr.dtype.element_ty, INTERP), mask=d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA); cached, it is asked on every launch."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 1


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAX_SPLITS = 64
# Split counts are powers of two, so the launcher can only pick these seven: every one is compiled in the
# sm_90 check and at warm-up (``NUM_SPLITS`` is a compile-time constant; 64 arbitrary values would be 64
# kernels, compiled at the first request that happened to need each).
SPLIT_CHOICES = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))


def choose_num_splits(num_tokens: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Split the key axis when (tokens x KV heads) programs cannot fill the GPU and keys are long.

    Uses shapes only (``max_kv_len`` = block-table width x block size), never device values, so it does not
    sync. Each split keeps at least 512 keys, so short contexts are never split. Always one of
    ``SPLIT_CHOICES`` (rounded down to a power of two).
    """
    if interpreting() or device.type != "cuda":
        return 1
    programs = num_tokens * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return pow2_floor(min(math.ceil(2 * sms / programs), max_splits(max_kv_len)))


def max_splits(max_kv_len: int) -> int:
    """The most splits a batch with keys up to ``max_kv_len`` can get (each split keeps >= 512 keys)."""
    return pow2_floor(min(max(1, max_kv_len // 512), MAX_SPLITS))


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs ``[T, H, S, D]`` and (max, sum) ``[T, H, S, 2]`` in float32.

    With one split the kernels write ``out`` directly and never touch these, so ``out`` stands in.
    """
    if num_splits <= 1:
        return out, out
    t, h, d = out.shape
    part_o = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=out.device)
    part_ml = torch.empty(t, h, num_splits, 2, dtype=torch.float32, device=out.device)
    return part_o, part_ml


def reduce_splits(part_o: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, num_splits: int,
                  sinks: torch.Tensor | None = None) -> None:
    """Merge the split-KV partials into ``out`` (a no-op with one split); ``sinks [Hq]`` float32 adds each
    head's sink term to the denominator."""
    if num_splits <= 1:
        return
    t, h, d = out.shape
    _reduce_kernel[(t, h)](
        part_o, part_ml, out, sinks if sinks is not None else part_ml, out.stride(0), out.stride(1),
        **reduce_constexprs(h, d, num_splits, interpreting(), sinks is not None),
    )  # fmt: skip


# ---- launch configurations: one source of truth for the launchers, the sm_90 check and the warm-up -----


def paged_tile(decode_only: bool, group: int, interp: bool) -> tuple[int, int, int]:
    """``(BLOCK_Q, BLOCK_M, BLOCK_N)`` for a batch. Decode-only batches (one token per sequence) use
    ``BLOCK_Q = 1``; mixed batches tile queries so each key tile is reused across up to ``BLOCK_Q`` tokens
    of a prefill chunk. The interpreter uses smaller tiles (same code, faster on CPU)."""
    if decode_only:
        block_m = max(16, next_pow2(group))
    else:
        block_m = max(32 if interp else 64, next_pow2(group))
    return max(1, block_m // group), block_m, 32 if interp else 64


def paged_constexprs(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_only: bool,
                     num_splits: int, dtype: torch.dtype, interp: bool, quant: int = 0, group_size: int = 1,
                     sinks: bool = False) -> dict:
    """The compile-time arguments of ``_paged_attn_kernel`` for one launch."""
    group = num_q_heads // num_kv_heads
    block_q, block_m, block_n = paged_tile(decode_only, group, interp)
    return dict(
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        HALF=max(16, next_pow2(head_dim // 2)),  # tl.dot needs K >= 16; padded channels are masked
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        QUANT=quant, GROUP_SIZE=group_size, HAS_SINKS=sinks, DOT_PREC=dot_precision(dtype), INTERP=interp,
    )  # fmt: skip


# Accumulator elements (fp32, both half tiles) each thread may hold before the tile gets more warps: past
# this the registers spill. Llama-3-8B's mixed tile (64 rows x 128 channels) keeps Triton's 4 warps; a head
# size of 256 (Gemma-3) doubles the accumulators and gets 8.
ACC_PER_THREAD = 64
# Software-pipelining stages: Triton's sm_90 default, stated so the sm_90 check compiles what launches.
NUM_STAGES = 3
# A packed (int8/int4) cache read in float32 pipelines each stage's fp32 K/V tiles through shared memory,
# about 2 x BLOCK_N x head_dim x 4 bytes a stage (sm_90 compiles, Triton 3.x): at 3 stages Llama-3-8B's
# mixed tile took 230,912 B, 1.5 KB under the limit, and Gemma-3's (head_dim 256) 411-460 KB, over it --
# a launch that fails on the device only. So float32 packed tiles get 2 stages up to head_dim 128 and 1
# beyond (Gemma-3: 147 KB decode, 197 KB mixed). 16-bit tiles stay at NUM_STAGES (51 KB for Gemma-3's).
PACKED_FP32_STAGES = 2
PACKED_FP32_WIDE_HEAD = 128  # head sizes above this get one stage
# Shared memory one program may use on sm_90 (H100/H200: 227 KiB opt-in per block).
SM90_MAX_SHARED = 232448


def paged_options(consts: dict) -> dict:
    """``num_warps`` / ``num_stages`` of one ``_paged_attn_kernel`` launch, from its compile-time arguments:
    enough warps that the ``[BLOCK_M, 2 * HALF]`` fp32 accumulators stay at ``ACC_PER_THREAD`` per thread
    (4 to 8 warps).

    >>> paged_options(paged_constexprs(32, 8, 128, 16, False, 1, torch.bfloat16, False))  # Llama-3-8B, mixed
    {'num_warps': 4, 'num_stages': 3}
    >>> paged_options(paged_constexprs(8, 4, 256, 16, False, 1, torch.bfloat16, False))   # Gemma-3, mixed
    {'num_warps': 8, 'num_stages': 3}
    >>> paged_options(paged_constexprs(8, 4, 256, 16, True, 1, torch.bfloat16, False))    # Gemma-3, decode
    {'num_warps': 4, 'num_stages': 3}
    >>> paged_options(paged_constexprs(8, 4, 256, 64, False, 1, torch.float32, False, quant=4, group_size=64))
    {'num_warps': 8, 'num_stages': 1}
    >>> paged_options(paged_constexprs(32, 8, 128, 64, False, 1, torch.float32, False, quant=4, group_size=64))
    {'num_warps': 4, 'num_stages': 2}

    Stages: ``NUM_STAGES``, fewer for float32 tiles over a packed cache (``PACKED_FP32_STAGES``, 1 past
    ``PACKED_FP32_WIDE_HEAD``); the sm_90 check compiles these and holds them to ``SM90_MAX_SHARED``.
    """
    acc = consts["BLOCK_M"] * 2 * consts["HALF"]
    warps = min(8, max(4, next_pow2(-(-acc // (32 * ACC_PER_THREAD)))))
    stages = NUM_STAGES
    if consts["QUANT"] and consts["DOT_PREC"] == "ieee":  # float32 tiles (dot_precision) over packed KV
        stages = PACKED_FP32_STAGES if 2 * consts["HALF"] <= PACKED_FP32_WIDE_HEAD else 1
    return dict(num_warps=warps, num_stages=stages)


def reduce_constexprs(num_q_heads: int, head_dim: int, num_splits: int, interp: bool, sinks: bool = False) -> dict:
    """The compile-time arguments of ``_reduce_kernel`` (launched only when ``num_splits > 1``)."""
    return dict(NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim), NUM_SPLITS=num_splits,
                SPLITS_PAD=next_pow2(num_splits), HAS_SINKS=sinks, INTERP=interp)


def write_kv_constexprs(num_kv_heads: int, head_dim: int, interp: bool) -> dict:
    """The compile-time arguments of ``_write_kv_kernel``."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=next_pow2(num_kv_heads), D_PAD=next_pow2(head_dim),
                INTERP=interp)


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant the engine's Triton backend can launch, and how the launcher reaches it."""

    kernel: str  # "paged_attention", "reduce", "write_kv" or "sparse_attention" (sinkserve_kernels.sparse_attention)
    constexprs: tuple[tuple[str, object], ...]
    decode_only: bool = False
    num_splits: int = 1
    # Launch options (num_warps, num_stages) beside the constexprs; empty: Triton's defaults.
    options: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        c = dict(self.constexprs)
        if self.kernel == "paged_attention":
            return (f"paged {c['DOT_PREC']} BLOCK_Q={c['BLOCK_Q']} BLOCK_M={c['BLOCK_M']} BLOCK_N={c['BLOCK_N']} "
                    f"splits={c['NUM_SPLITS']}")
        if self.kernel == "reduce":
            return f"reduce splits={c['NUM_SPLITS']}"
        if self.kernel == "sparse_attention":
            return f"sparse {c['DOT_PREC']} QUANT={c['QUANT']} splits={c['NUM_SPLITS']}"
        return "write_kv"


def engine_launch_configs(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                          interp: bool = False, max_model_len: int | None = None,
                          sinks: bool = False, quant: int = 0, group_size: int = 1) -> list[KernelConfig]:
    """Every kernel configuration the engine's attention backend (``write_kv`` + ``paged_attention``,
    split count from ``choose_num_splits``) can launch for one model shape and dtype, compiled mode by
    default; ``max_model_len`` bounds the split counts (short models never split); ``sinks``: the model
    has learned sinks (every attention launch carries them); ``quant`` (8 or 4) and ``group_size``: a packed
    KV cache (``sinkserve_kernels.kv_quant``), whose attention reads codes and the 16-bit side pool. Built from the
    same functions the launchers call, so it cannot drift from them. Integer arguments that change per step
    are not specialized (``sinkserve_kernels._triton.PER_STEP_INTS``), so these are all the variants there are."""
    top = MAX_SPLITS if max_model_len is None else max_splits(-(-max_model_len // block_size) * block_size)
    splits_choices = [s for s in SPLIT_CHOICES if s <= top]
    configs = [KernelConfig("write_kv", tuple(write_kv_constexprs(num_kv_heads, head_dim, interp).items()))]
    for decode_only in (True, False):
        for splits in splits_choices:
            c = paged_constexprs(num_q_heads, num_kv_heads, head_dim, block_size, decode_only, splits, dtype, interp,
                                 quant=quant, group_size=group_size if quant else 1, sinks=sinks)
            configs.append(KernelConfig("paged_attention", tuple(c.items()), decode_only, splits,
                                        tuple(paged_options(c).items())))
    for splits in splits_choices[1:]:
        configs.append(KernelConfig("reduce", tuple(reduce_constexprs(num_q_heads, head_dim, splits, interp, sinks).items()),
                                    num_splits=splits))
    return configs


def launch_paged_attention(
    query: torch.Tensor,
    kv: KVSource,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the paged-attention kernel over any ``KVSource`` (16-bit or quantized). Returns ``[T, Hq, D]``.
    ``window``: sliding-window layer; ``sinks [Hq]``: learned sink logits (``sinkserve_kernels.torch_kernels``)."""
    check_device(query, kv.k, block_tables)
    num_tokens, hq, d = query.shape
    if d != kv.head_dim:
        raise ValueError(f"query head_dim {d} != cache head_dim {kv.head_dim}")
    if hq % kv.num_kv_heads:
        raise ValueError(f"{hq} query heads not a multiple of {kv.num_kv_heads} KV heads")
    out = torch.empty_like(query) if out is None else out
    num_seqs = int(seq_lens.shape[0])
    if num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()

    max_kv_len = int(block_tables.shape[1]) * kv.block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, kv.num_kv_heads, max_kv_len, query.device)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if sinks is not None:
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape ({hq},), got {tuple(sinks.shape)}")
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    consts = paged_constexprs(hq, kv.num_kv_heads, d, kv.block_size, num_tokens == num_seqs, num_splits, query.dtype,
                              interpreting(), kv.quant, kv.group_size, sinks is not None)
    grid = (num_tokens // consts["BLOCK_Q"] + num_seqs, kv.num_kv_heads, num_splits)
    part_o, part_ml = split_buffers(out, num_splits)
    _paged_attn_kernel[grid](
        query, out, part_o, part_ml, *kv.pointers(),
        block_tables, block_tables.stride(0), seq_lens, query_start_loc, sinks if sinks is not None else query,
        num_seqs, NO_WINDOW if window is None else window, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), **consts, **paged_options(consts),
    )  # fmt: skip
    reduce_splits(part_o, part_ml, out, num_splits, sinks)
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, Hq, D]`` over paged caches; returns ``[T, Hq, D]``.

    Drop-in for ``sinkserve_kernels.torch_kernels.paged_attention`` (``window``, ``sinks`` as there). ``num_splits``
    forces the split-KV path (``None`` picks it from shapes: only when tokens x KV heads cannot fill the
    GPU). ``out`` (optional, like ``query``) receives the result.
    """
    return launch_paged_attention(
        query, plain_source(k_cache, v_cache), block_tables, seq_lens, query_start_loc, scale, num_splits, out,
        window, sinks,
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    INTERP: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # negative slot: this token's KV must not be stored
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        m = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
        v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
        dst = slot * NUM_KV_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
        tl.store(k_cache_ptr + dst, cast_out(k, k_cache_ptr.dtype.element_ty, INTERP), mask=m)
        tl.store(v_cache_ptr + dst, cast_out(v, v_cache_ptr.dtype.element_ty, INTERP), mask=m)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into the caches at flat slots; slots < 0 are skipped.

    Drop-in for ``sinkserve_kernels.torch_kernels.write_kv`` (values are cast to the cache dtype).
    """
    check_device(key, k_cache)
    plain_source(k_cache, v_cache)  # validates shape/contiguity
    num_tokens = int(key.shape[0])
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _, _, hkv, d = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        **write_kv_constexprs(hkv, d, interpreting()),
    )  # fmt: skip
