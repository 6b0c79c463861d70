"""Fused float32 CPU ops for the native forward (``sinkserve_kernels/csrc/cpu_ops.c``), with torch fallbacks.

Each replaces several small ATen kernels on a few hundred floats -- where dispatch, not arithmetic, is
the cost -- by one C call: ``rms_norm`` (torch 2.13 runs 7 kernels for ``F.rms_norm`` on CPU),
``add_rms_norm`` (the residual add and the next norm in one pass) and ``write_kv`` / ``write_kv_quant``
(the paged KV write -- into a packed cache's 16-bit pool for the latter -- without the mask and host
sync the reference needs for padding slots), and ``greedy`` (the sampler's argmax and its log-probability).
Anything that is not a contiguous float32 CPU tensor --
and every tensor when the library could not be built -- takes the torch path, which is exactly what
the reference computes.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from sinkserve_kernels import torch_kernels
from sinkserve_kernels.cpu_lib import load


_F32 = torch.float32


def _ok(t: torch.Tensor) -> bool:
    # Called several times per layer and step: attribute checks only.
    return t.dtype is _F32 and t.is_cpu and t.stride(-1) == 1


def _fast(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if not _ok(t):
            return False
    return load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (n,), weight, eps)`` over rows ``x [T, n]`` (row stride free, last dim contiguous)."""
    if x.dim() != 2 or not _fast(x) or (weight is not None and not (_fast(weight) and weight.is_contiguous())):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=torch.float32)
    load().sinkserve_rms_norm(x.data_ptr(), x.stride(0), None if weight is None else weight.data_ptr(), out.data_ptr(),
                              x.shape[0], x.shape[1], eps)
    return out


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``h += r`` in place (the residual stream), then ``rms_norm(h)``; ``h [T, n]`` contiguous."""
    if h.dim() != 2 or not (h.is_contiguous() and _fast(h, r)) or (weight is not None and not _fast(weight)):
        h.add_(r)
        return F.rms_norm(h, (h.shape[-1],), weight, eps)
    out = torch.empty(h.shape, dtype=torch.float32)
    load().sinkserve_add_rms_norm(h.data_ptr(), r.data_ptr(), r.stride(0), None if weight is None else weight.data_ptr(),
                                  out.data_ptr(), h.shape[0], h.shape[1], eps)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``sinkserve_kernels.torch_kernels.write_kv`` (slots < 0 skipped) in one pass over strided ``[T, Hkv, D]`` keys/values."""
    if not (_fast(key, value, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        torch_kernels.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    t, hkv, d = key.shape
    if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"keys {tuple(key.shape)} do not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    slots = k_cache.shape[0] * k_cache.shape[1]
    rc = load().sinkserve_write_kv(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                                   value.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t,
                                   hkv, d, slots, None, 0, 0)
    if rc != 0:
        raise IndexError(f"slot_mapping has a slot >= the cache's {slots} slots")


def write_kv_quant(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor) -> None:
    """``sinkserve_kernels.torch_kernels.write_kv_quant`` in one pass: tokens of 16-bit-resident blocks land in their side-pool
    slots (through ``cache.fp_index``), tokens of packed blocks and slots < 0 are skipped."""
    if not (_fast(key, value, cache.fp_k, cache.fp_v) and cache.fp_k.is_contiguous() and cache.fp_v.is_contiguous()
            and cache.fp_index.dtype == torch.int32 and cache.fp_index.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        torch_kernels.write_kv_quant(key, value, cache, slot_mapping)
        return
    t, hkv, d = key.shape
    if cache.fp_k.shape[2:] != (hkv, d) or cache.fp_v.shape != cache.fp_k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"keys {tuple(key.shape)} do not fit the 16-bit pool {tuple(cache.fp_k.shape)} or their "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    b = cache.block_size
    slots, fp_slots = cache.num_blocks * b, cache.fp_k.shape[0] * b
    rc = load().sinkserve_write_kv(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                                   value.stride(1), cache.fp_k.data_ptr(), cache.fp_v.data_ptr(), slot_mapping.data_ptr(),
                                   t, hkv, d, slots, cache.fp_index.data_ptr(), b, fp_slots)
    if rc != 0:
        raise IndexError(f"slot_mapping has a slot >= the cache's {slots} slots, or a block maps past the "
                         f"16-bit pool's {fp_slots} slots")


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Per row of ``logits [B, V]``: ``argmax`` (the first of equal maxima) and its log-probability under
    ``log_softmax`` of the row -- the sampler's all-greedy step as one C call instead of four ATen kernels
    and two host copies. Torch ops where the C path does not apply (the reference)."""
    if not (logits.dim() == 2 and _fast(logits) and logits.is_contiguous() and logits.shape[1] > 0):
        tokens = torch.argmax(logits, dim=-1)
        return tokens.tolist(), torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
    rows = logits.shape[0]
    tokens, lps = (ctypes.c_int64 * rows)(), (ctypes.c_float * rows)()
    load().sinkserve_greedy(logits.data_ptr(), rows, logits.shape[1], tokens, lps)
    return list(tokens), list(lps)
