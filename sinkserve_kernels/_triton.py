"""Shared Triton plumbing: interpreter fallback, launch helpers and the ``@triton.jit`` helpers every kernel uses.

Import Triton through this module (``from sinkserve_kernels._triton import triton, tl``) so that, on a machine
without CUDA, ``TRITON_INTERPRET=1`` is set before the first ``@triton.jit`` decorator runs: Triton
decides between compiling and interpreting a kernel when it is decorated, and without a GPU only the
interpreter can run it.

Every kernel works on *half* head-dims: a head vector of ``D`` channels is handled as two tiles
``[0, D/2)`` and ``[D/2, D)``. That is what lets one kernel body read 16-bit, int8 and packed-int4 KV
(int4 packs channel ``c`` and ``c + D/2`` into one byte, see ``sinkserve_kernels.kv_quant``) without an in-register
interleave, at the cost of two ``tl.dot`` calls of depth ``D/2`` instead of one of depth ``D``.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # No GPU: Triton cannot compile, so run the kernels in its (exact, slow) CPU interpreter.
    os.environ["TRITON_INTERPRET"] = "1"
    logger.info("no CUDA device: running Triton kernels with TRITON_INTERPRET=1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _interpret_preimported_stdlib() -> None:
    """Make Triton's own ``@jit`` library functions (``tl.zeros``, ``tl.cumsum``, ...) interpretable.

    Triton wraps a function for compile or for interpret when it is *decorated*. If something imported
    Triton before ``TRITON_INTERPRET=1`` was set (transformers does, through torch), ``triton.language``'s
    helpers are compile-mode ``JITFunction``s and an interpreted kernel calling them fails with "Cannot
    call @triton.jit'd outside of the scope of a kernel". Re-wrap them for the interpreter.
    """
    import sys
    import types

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        if not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attr, InterpretedFunction(value.fn))


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and isinstance(tl.zeros, triton.runtime.jit.JITFunction):
    _interpret_preimported_stdlib()

# Integer kernel arguments whose values change from step to step (batch size, table widths, selection
# sizes). Triton specializes an integer argument on ``== 1`` and ``% 16 == 0`` unless told not to, so each
# would double the compiled variants, and a variant not met at warm-up compiles on a live request (a
# batch of one, a table 16 blocks wide). Listed here, they compile once for any value. Model constants
# (tensor strides) keep their specialization: the warm-up meets the same values.
# (tests/kernels/test_launch_configs.py checks that the engine's launches vary in nothing else.)
PER_STEP_INTS: dict[str, list[str]] = {
    "paged_attention": ["stride_bt", "num_seqs", "window"],
    "sparse_attention": ["num_selected", "stride_st"],
    "indexer": ["stride_bt", "num_seqs", "token_offset", "num_cols", "stride_out"],
    "topk": ["stride_bt", "stride_forced", "num_seqs", "token_offset", "num_cols", "window", "k", "stride_s",
             "stride_o"],
}

__all__ = [
    "triton", "tl", "PER_STEP_INTS", "next_pow2", "interpreting", "check_device", "dot_precision", "find_seq", "find_token_seq",
    "load_kv", "mma", "cast_out",
]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (``tl.arange`` extents must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_device(*tensors: torch.Tensor) -> None:
    """Fail early with a readable message instead of a Triton crash on a wrong device."""
    want_cuda = not interpreting()
    for t in tensors:
        if t is None:
            continue
        if want_cuda and not t.is_cuda:
            raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact IEEE dots (TF32 would cost ~1e-3 relative error); 16-bit inputs use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest sequence ``s`` whose first query tile ``qsl[s] // BLOCK_Q + s`` is <= ``pid`` (binary search).

    Tiles are numbered without a host sync: sequence ``s`` owns tile ids starting at
    ``qsl[s] // BLOCK_Q + s``, which leaves room for its ``cdiv(q_len, BLOCK_Q)`` tiles, so the grid needs
    at most ``T // BLOCK_Q + S`` programs.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def load_kv(
    slots,
    valid,
    kv_head,
    k_ptr,
    v_ptr,
    fpk_ptr,
    fpv_ptr,
    fp_index_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Load keys/values of ``slots`` (flat ``block * BLOCK_SIZE + offset``) for one KV head as half tiles.

    Returns ``(k_lo, k_hi, v_lo, v_hi)``, each ``[N, HALF]``; invalid rows read as 0. ``QUANT == 0``:
    ``k_ptr/v_ptr`` are 16/32-bit caches ``[num_blocks, BLOCK_SIZE, H, D]`` and tiles keep their dtype.
    ``QUANT in (8, 4)``: ``k_ptr/v_ptr`` hold codes, blocks with ``fp_index[block] >= 0`` are read from the
    16-bit pool ``fpk/fpv`` instead, and tiles come back dequantized in fp32.
    """
    HD2: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    dmask = offs < HD2
    slots = slots.to(tl.int64)
    row = (slots * NUM_KV_HEADS + kv_head) * HEAD_DIM
    if QUANT == 0:
        m2 = valid[:, None] & dmask[None, :]
        k_lo = tl.load(k_ptr + row[:, None] + offs[None, :], mask=m2, other=0.0)
        k_hi = tl.load(k_ptr + row[:, None] + HD2 + offs[None, :], mask=m2, other=0.0)
        v_lo = tl.load(v_ptr + row[:, None] + offs[None, :], mask=m2, other=0.0)
        v_hi = tl.load(v_ptr + row[:, None] + HD2 + offs[None, :], mask=m2, other=0.0)
    else:
        blk = slots // BLOCK_SIZE
        off = slots % BLOCK_SIZE
        fp = tl.load(fp_index_ptr + blk, mask=valid, other=-1).to(tl.int64)
        is_fp = valid & (fp >= 0)
        is_q = valid & (fp < 0)
        mf = is_fp[:, None] & dmask[None, :]
        mq = is_q[:, None] & dmask[None, :]
        # Protected / residual-window blocks: plain 16-bit rows of the side pool (masked loads cost nothing
        # for rows that live in the quantized pool, and vice versa).
        fp_row = ((fp * BLOCK_SIZE + off) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        fk_lo = tl.load(fpk_ptr + fp_row[:, None] + offs[None, :], mask=mf, other=0.0).to(tl.float32)
        fk_hi = tl.load(fpk_ptr + fp_row[:, None] + HD2 + offs[None, :], mask=mf, other=0.0).to(tl.float32)
        fv_lo = tl.load(fpv_ptr + fp_row[:, None] + offs[None, :], mask=mf, other=0.0).to(tl.float32)
        fv_hi = tl.load(fpv_ptr + fp_row[:, None] + HD2 + offs[None, :], mask=mf, other=0.0).to(tl.float32)
        if QUANT == 8:
            ck_lo = tl.load(k_ptr + row[:, None] + offs[None, :], mask=mq, other=0).to(tl.float32)
            ck_hi = tl.load(k_ptr + row[:, None] + HD2 + offs[None, :], mask=mq, other=0).to(tl.float32)
            cv_lo = tl.load(v_ptr + row[:, None] + offs[None, :], mask=mq, other=0).to(tl.float32)
            cv_hi = tl.load(v_ptr + row[:, None] + HD2 + offs[None, :], mask=mq, other=0).to(tl.float32)
        else:
            # Packed int4: byte c of a row holds channel c (low nibble) and channel c + D/2 (high nibble).
            prow = (slots * NUM_KV_HEADS + kv_head) * HD2
            kb = tl.load(k_ptr + prow[:, None] + offs[None, :], mask=mq, other=0).to(tl.int32)
            vb = tl.load(v_ptr + prow[:, None] + offs[None, :], mask=mq, other=0).to(tl.int32)
            ck_lo = (kb & 15).to(tl.float32)
            ck_hi = ((kb >> 4) & 15).to(tl.float32)
            cv_lo = (vb & 15).to(tl.float32)
            cv_hi = ((vb >> 4) & 15).to(tl.float32)
        # Keys: one (scale, min) per channel per block -> [num_blocks, H, D].
        krow = (blk * NUM_KV_HEADS + kv_head) * HEAD_DIM
        ks_lo = tl.load(ks_ptr + krow[:, None] + offs[None, :], mask=mq, other=0.0).to(tl.float32)
        ks_hi = tl.load(ks_ptr + krow[:, None] + HD2 + offs[None, :], mask=mq, other=0.0).to(tl.float32)
        kz_lo = tl.load(kz_ptr + krow[:, None] + offs[None, :], mask=mq, other=0.0).to(tl.float32)
        kz_hi = tl.load(kz_ptr + krow[:, None] + HD2 + offs[None, :], mask=mq, other=0.0).to(tl.float32)
        # Values: one (scale, min) per token per GROUP_SIZE channels -> [num_blocks, BLOCK_SIZE, H, D / G].
        NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
        vrow = (slots * NUM_KV_HEADS + kv_head) * NG
        g_lo = offs // GROUP_SIZE
        g_hi = (offs + HD2) // GROUP_SIZE
        vs_lo = tl.load(vs_ptr + vrow[:, None] + g_lo[None, :], mask=mq, other=0.0).to(tl.float32)
        vs_hi = tl.load(vs_ptr + vrow[:, None] + g_hi[None, :], mask=mq, other=0.0).to(tl.float32)
        vz_lo = tl.load(vz_ptr + vrow[:, None] + g_lo[None, :], mask=mq, other=0.0).to(tl.float32)
        vz_hi = tl.load(vz_ptr + vrow[:, None] + g_hi[None, :], mask=mq, other=0.0).to(tl.float32)
        k_lo = tl.where(is_fp[:, None], fk_lo, ck_lo * ks_lo + kz_lo)
        k_hi = tl.where(is_fp[:, None], fk_hi, ck_hi * ks_hi + kz_hi)
        v_lo = tl.where(is_fp[:, None], fv_lo, cv_lo * vs_lo + vz_lo)
        v_hi = tl.where(is_fp[:, None], fv_hi, cv_hi * vs_hi + vz_hi)
    return k_lo, k_hi, v_lo, v_hi


@triton.jit
def find_token_seq(qsl_ptr, num_seqs, tok):
    """Sequence owning packed query token ``tok``: the largest ``s`` with ``qsl[s] <= tok`` (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= tok:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def mma(a, b, DT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation, operands in ``DT`` (tensor cores for 16-bit).

    ``UPCAST`` (set under the interpreter) computes in fp32 instead: the interpreter stores bf16 as raw
    uint16 and would multiply the bit patterns.
    """
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a.to(DT), b.to(DT), input_precision=DOT_PREC)
    return out


@triton.jit
def cast_out(x, DT: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Cast fp32 ``x`` to ``DT`` rounding to nearest even.

    GPUs round fp32 -> bf16 to nearest even; the interpreter truncates, so under it (``EMULATE_RTNE``)
    round the bit pattern first (add 0x7FFF plus the lowest kept bit) and clear the dropped bits, so the
    interpreter's conversion only sees exactly representable values (it mishandles fp32 subnormals).
    """
    if EMULATE_RTNE and DT == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DT)
