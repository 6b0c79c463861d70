"""The ``cpu`` attention backend: the torch reference, with decode attention in a small C kernel.

On CPU the reference's decode attention costs more than the model's matmuls at batch 32: per layer it
copies every sequence's context out of the paged cache (``index_select``), builds a mask and calls
SDPA, whose CPU kernel is tuned for long query blocks, not one query row. ``csrc/decode_attention.c``
reads each key and value once, straight from the blocks the table names, with one query token per
sequence (see its header for the exact semantics: null blocks, sliding windows, sinks). Everything
else -- prefill segments, KV writes, quantized and sparse attention -- is the reference's.

The C file is compiled once per machine (``kernels/cpu_lib.py``); no compiler or a failed build ->
``load()`` returns None and the engine runs the plain ``torch`` backend (one log line). Float32 caches
only (other dtypes: the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import reference
from kernels.cpu_lib import load

__all__ = ["CpuPlan", "load", "paged_attention", "paged_attention_quant", "plan"]

@dataclass
class CpuPlan:
    """The step's metadata for one sliding window, read once per step and shared by every layer: int32
    copies of the tables and lengths in the layout the kernel reads, the longest context (sizing the
    score scratch), whether every sequence decodes one token (then the kernel does the whole layer), and
    the reference plan, built only when a layer needs it (prefill segments, quantized KV)."""

    args: tuple
    decode_only: bool
    tables: torch.Tensor  # [S, W] int32, contiguous
    lens: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S + 1] int32
    longest: int
    _full: reference.AttentionPlan | None = field(default=None, repr=False)
    _scratch: torch.Tensor | None = field(default=None, repr=False)

    def full(self) -> reference.AttentionPlan:
        if self._full is None:
            self._full = reference.plan_attention(*self.args)
        return self._full

    def scratch(self, numel: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(max(1, numel), dtype=torch.float32)
        return self._scratch


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
         window: int | None = None) -> CpuPlan:
    """``AttentionBackend.plan``: two host reads (CPU tensors: no device sync)."""
    num = query_start_loc.shape[0] - 1
    lens = seq_lens.to(torch.int32).contiguous()
    return CpuPlan((block_tables, seq_lens, query_start_loc, block_size, window),
                   decode_only=int(query_start_loc[num]) == num,
                   tables=block_tables.to(torch.int32).contiguous(), lens=lens,
                   starts=query_start_loc.to(torch.int32).contiguous(), longest=int(lens.max()) if num else 0)


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
    span = min(plan.longest, window) if window is not None else plan.longest
    scratch = plan.scratch(span * min(hq // hkv, 16))
    sink_ptr = None
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        sink_ptr = sinks.data_ptr()
    rc = lib.sinkserve_decode_attention(  # signature: kernels/cpu_lib.py
        query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        plan.tables.data_ptr(), plan.tables.stride(0), plan.lens.data_ptr(), plan.starts.data_ptr(),
        plan.lens.shape[0], hq, hkv, d, block, float(scale), window or 0, sink_ptr, out.data_ptr(),
        scratch.data_ptr(), scratch.numel())
    if rc != 0:
        raise RuntimeError(f"decode attention kernel refused its arguments (code {rc})")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None, plan: CpuPlan | None = None) -> torch.Tensor:
    """``kernels.reference.paged_attention`` with the one-token segments computed by the C kernel."""
    plan = plan or globals()["plan"](block_tables, seq_lens, query_start_loc, k_cache.shape[1], window)
    if not _kernel_ok(query, k_cache, v_cache):
        return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         window, sinks, plan=plan.full())
    if plan.decode_only:
        out = torch.empty(query.shape, dtype=query.dtype)
    else:  # prefill segments through the reference; the decode rows are overwritten below
        prefill_only = reference.AttentionPlan(None, None, None, plan.full().prefill)
        out = reference._paged_attention(query, lambda g: reference._gather_fp(k_cache, v_cache, g), prefill_only,
                                         scale, sinks).contiguous()
    decode_rows(query, k_cache, v_cache, plan, scale, window, sinks, out)
    return out


def paged_attention_quant(query: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                          sinks: torch.Tensor | None = None, plan: CpuPlan | None = None) -> torch.Tensor:
    """Quantized KV: the reference's, with the reference plan."""
    return reference.paged_attention_quant(query, cache, block_tables, seq_lens, query_start_loc, scale, window=window,
                                           sinks=sinks, plan=None if plan is None else plan.full())
