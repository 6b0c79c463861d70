"""The ``cpu`` attention backend: the torch reference, with decode attention in a small C kernel.

On CPU the reference's decode attention costs more than the model's matmuls at batch 32: per layer it
copies every sequence's context out of the paged cache (``index_select``), builds a mask and calls
SDPA, whose CPU kernel is tuned for long query blocks, not one query row. ``csrc/decode_attention.c``
reads each key and value once, straight from the blocks the table names, with one query token per
sequence (see its header for the exact semantics: null blocks, sliding windows, sinks).

A packed cache (``kv_cache_dtype`` int8 / int4 / int2) goes through the same file's one online-softmax
core: for each block the table names it reads either the 16-bit side-pool block in place or the packed
codes with their scales (and the outlier key channels' 16-bit copies), decoding a chunk of tokens at a
time into a small tile. The torch path it replaces
(``sinkserve_kernels/packed_decode.py``: gather split by precision, dequantize, SDPA; ~25 torch ops per layer)
stays the reference and the ``torch`` backend's path::

    table [ 7 | 12 | 0 | 3 | 9 ]    fp_index: 7 -> 0, 9 -> 1, 12 and 3 -> -1
            |   |    |   |   |
            |   |    |   |   '-- 16-bit: fp_k[1], fp_v[1] read in place
            |   '----|---'------ packed: codes * scale + zero (+ outlier channels) -> tile
            |        '---------- null block: skipped
            '------------------- 16-bit: fp_k[0], fp_v[0] read in place

Prefill segments, sparse attention and the quantization of blocks are the reference's.

The C files are compiled once per machine (``sinkserve_kernels/cpu_lib.py``); no compiler or a failed build ->
``load()`` returns None and the engine runs the plain ``torch`` backend (one log line). Float32 caches
and 16-bit pools only (other dtypes: the reference).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from sinkserve_kernels import torch_kernels
from sinkserve_kernels.cpu_lib import load

__all__ = ["CpuPlan", "load", "paged_attention", "paged_attention_quant", "plan", "quant_cache_args", "quant_kernel_ok"]

@dataclass
class CpuPlan:
    """The step's metadata for one sliding window, read once per step and shared by every layer: int32
    copies of the tables and lengths in the layout the kernel reads, whether every sequence decodes one
    token (then the kernel does the whole layer), and the reference plan, built only when a layer needs it
    (prefill segments, quantized KV)."""

    args: tuple
    decode_only: bool
    tables: torch.Tensor  # [S, W] int32, contiguous
    lens: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S + 1] int32
    _full: torch_kernels.AttentionPlan | None = field(default=None, repr=False)

    def full(self) -> torch_kernels.AttentionPlan:
        if self._full is None:
            self._full = torch_kernels.plan_attention(*self.args)
        return self._full


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
         window: int | None = None) -> CpuPlan:
    """``AttentionBackend.plan``: two host reads (CPU tensors: no device sync)."""
    num = query_start_loc.shape[0] - 1
    lens = seq_lens.to(torch.int32).contiguous()
    return CpuPlan((block_tables, seq_lens, query_start_loc, block_size, window),
                   decode_only=int(query_start_loc[num]) == num,
                   tables=block_tables.to(torch.int32).contiguous(), lens=lens,
                   starts=query_start_loc.to(torch.int32).contiguous())


def _kernel_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (query.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and query.device.type == "cpu"
            and k_cache.is_contiguous() and v_cache.is_contiguous() and query.stride(-1) == 1
            and query.shape[-1] <= 256)


def decode_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CpuPlan, scale: float,
                window: int | None, sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write into ``out [T, Hq, D]`` (contiguous) the attention of every one-token query segment (other
    rows untouched)."""
    lib = load()
    assert lib is not None and out.is_contiguous()
    _, hq, d = query.shape
    _, block, hkv, _ = k_cache.shape
    sink_ptr = None
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        sink_ptr = sinks.data_ptr()
    rc = lib.sinkserve_decode_attention(  # signature: sinkserve_kernels/cpu_lib.py
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        plan.tables.data_ptr(), plan.tables.stride(0), plan.lens.data_ptr(), plan.starts.data_ptr(),
        plan.lens.shape[0], hq, hkv, d, block, float(scale), window or 0, sink_ptr, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"decode attention kernel refused its arguments (code {rc})")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None, plan: CpuPlan | None = None) -> torch.Tensor:
    """``sinkserve_kernels.torch_kernels.paged_attention`` with the one-token segments computed by the C kernel."""
    plan = plan or globals()["plan"](block_tables, seq_lens, query_start_loc, k_cache.shape[1], window)
    if not _kernel_ok(query, k_cache, v_cache):
        return torch_kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         window, sinks, plan=plan.full())
    if plan.decode_only:
        out = torch.empty(query.shape, dtype=query.dtype)
    else:  # prefill segments through the reference; the decode rows are overwritten below
        prefill_only = torch_kernels.AttentionPlan(None, None, None, plan.full().prefill)
        out = torch_kernels._paged_attention(query, lambda g: torch_kernels._gather_fp(k_cache, v_cache, g), prefill_only,
                                         scale, sinks).contiguous()
    decode_rows(query, k_cache, v_cache, plan, scale, window, sinks, out)
    return out


class QuantCacheArgs(ctypes.Structure):
    """``csrc/decode_attention.h``'s ``QuantCache``: one layer's packed cache as the kernel reads it."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero",
                                                      "fp_k", "fp_v", "fp_index", "outlier_idx", "k_outlier")]
    _fields_ += [("bits", ctypes.c_int32), ("group", ctypes.c_int32), ("n_outlier", ctypes.c_int32)]


def quant_cache_args(cache) -> QuantCacheArgs:
    """One layer's ``sinkserve_kernels.kv_quant.QuantKVCache`` as ``csrc/decode_attention.h``'s ``QuantCache``: the addresses
    of its tensors (which the caller keeps alive and in place) and its bits, value group and outlier count."""
    o = 0 if cache.outlier_idx is None else int(cache.outlier_idx.shape[-1])
    return QuantCacheArgs(cache.k_codes.data_ptr(), cache.v_codes.data_ptr(), cache.k_scale.data_ptr(),
                          cache.k_zero.data_ptr(), cache.v_scale.data_ptr(), cache.v_zero.data_ptr(),
                          cache.fp_k.data_ptr(), cache.fp_v.data_ptr(), cache.fp_index.data_ptr(),
                          cache.outlier_idx.data_ptr() if o else None, cache.k_outlier.data_ptr() if o else None,
                          cache.bits, cache.group_size, o)


def quant_kernel_ok(query_dtype: torch.dtype, cache) -> bool:
    """``_quant_kernel_ok`` for a query of ``query_dtype`` (contiguous on the CPU): what the C decode step
    checks of a packed cache before binding it."""
    return _quant_kernel_ok(torch.empty(1, 1, cache.head_dim, dtype=query_dtype), cache)


def _quant_kernel_ok(query: torch.Tensor, cache) -> bool:
    """What the packed-decode kernel reads: float32 query and 16-bit side pool (and outlier copies), every
    cache tensor contiguous on the CPU, a head dim that the packings admit (a multiple of 4) up to 256."""
    d = query.shape[-1]
    tensors = [cache.k_codes, cache.v_codes, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero, cache.fp_k,
               cache.fp_v, cache.fp_index]
    if cache.outlier_idx is not None:
        if cache.k_outlier is None or cache.k_outlier.dtype != torch.float32 or cache.outlier_idx.dtype != torch.int64:
            return False
        tensors += [cache.outlier_idx, cache.k_outlier]
    return (query.dtype == cache.fp_k.dtype == cache.fp_v.dtype == torch.float32 and query.device.type == "cpu"
            and query.stride(-1) == 1 and d % 4 == 0 and 4 <= d <= 256 and cache.k_scale.dtype == torch.float16
            and cache.v_scale.dtype == torch.float16 and cache.fp_index.dtype == torch.int32
            and all(t.is_contiguous() and t.device.type == "cpu" for t in tensors))


def decode_rows_quant(query: torch.Tensor, cache, plan: CpuPlan, scale: float, window: int | None,
                      sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    """``decode_rows`` over a packed cache (``sinkserve_kernels.kv_quant.QuantKVCache``): each block is read where it
    lives, the 16-bit side pool or the packed codes with their scales (``csrc/decode_attention.c``'s core)."""
    lib = load()
    assert lib is not None and out.is_contiguous()
    _, hq, d = query.shape
    kv = quant_cache_args(cache)
    sink_ptr = None
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        sink_ptr = sinks.data_ptr()
    rc = lib.sinkserve_decode_attention_quant(  # signature: sinkserve_kernels/cpu_lib.py
        query.data_ptr(), query.stride(0), query.stride(1), ctypes.byref(kv), plan.tables.data_ptr(),
        plan.tables.stride(0), plan.lens.data_ptr(), plan.starts.data_ptr(), plan.lens.shape[0], hq,
        cache.num_kv_heads, d, cache.block_size, float(scale), window or 0, sink_ptr, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"packed decode attention kernel refused its arguments (code {rc})")


def paged_attention_quant(query: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                          sinks: torch.Tensor | None = None, plan: CpuPlan | None = None) -> torch.Tensor:
    """``sinkserve_kernels.torch_kernels.paged_attention_quant`` with the one-token segments computed by the C kernel
    (prefill segments dequantize on gather, as in the reference)."""
    plan = plan or globals()["plan"](block_tables, seq_lens, query_start_loc, cache.block_size, window)
    if not _quant_kernel_ok(query, cache):
        return torch_kernels.paged_attention_quant(query, cache, block_tables, seq_lens, query_start_loc, scale,
                                               window=window, sinks=sinks, plan=plan.full())
    if plan.decode_only:
        out = torch.empty(query.shape, dtype=query.dtype)
    else:  # prefill segments through the reference; the decode rows are overwritten below
        prefill_only = torch_kernels.AttentionPlan(None, None, None, plan.full().prefill)
        out = torch_kernels._paged_attention(query, lambda g: torch_kernels._gather_quant(cache, g, query.dtype), prefill_only,
                                         scale, sinks).contiguous()
    decode_rows_quant(query, cache, plan, scale, window, sinks, out)
    return out
