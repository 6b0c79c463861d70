"""Attention backends: the kernel entry points the engine calls, one set per backend.

A backend is two pure functions over the paged layout (``sinkserve_kernels/layout.py``):

    write_kv(key, value, k_cache, v_cache, slot_mapping)            -> None (in place)
    paged_attention(query, k_cache, v_cache, block_tables,
                    seq_lens, query_start_loc, scale,
                    window=None, sinks=None)                        -> [T, Hq, D]

``window`` (a sliding-window layer's width) and ``sinks`` (``[Hq]`` learned sink logits) are per layer
and keyword arguments of every attention entry point (``sinkserve_kernels/torch_kernels.py`` defines them).

``torch`` (``sinkserve_kernels/torch_kernels.py``) is the exact reference and runs everywhere; ``cpu``
(``sinkserve_kernels/cpu_attention.py``) is the reference with its decode attention in a small C kernel (what
``auto`` picks on CPU; the reference when no C compiler is there); ``triton`` runs the
Triton kernels (CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``), imported only when asked
for, so a CPU install never needs a working Triton compiler. A backend may also supply
``warm_up(shapes)``: compile every kernel configuration its launchers can pick for the engine's model,
so no request pays a JIT compile.

The engine names its backend in ``EngineConfig.attention_backend`` and takes it from :func:`get_backend`
(``"auto"`` follows the configured device: Triton on CUDA, ``cpu`` elsewhere); the engine depends on this
package, never the other way round, so a name or device this package cannot run is a
:class:`BackendError`, which the engine reports as its ``attention_backend`` setting.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class AttentionBackend:
    """The kernel entry points one backend supplies."""

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., Any]
    # (num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, max_model_len); None: nothing to compile
    warm_up: Callable[..., None] | None = None
    # (num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, force, quant, group_size): the sparse
    # attention kernel's variants (one per split count), for a pool with sparse attention; None: nothing to compile
    warm_up_sparse: Callable[..., int] | None = None
    # Quantized KV (``sinkserve_kernels.kv_quant.QuantKVCache`` in place of the two tensors):
    #   write_kv_quant(key, value, cache, slot_mapping)          new tokens into their 16-bit blocks
    #   paged_attention_quant(query, cache, block_tables, seq_lens, query_start_loc, scale, window, sinks)
    #   quantize_blocks(cache, block_ids, fp_slots)              pack 16-bit slots into blocks, once
    write_kv_quant: Callable[..., None] | None = None
    paged_attention_quant: Callable[..., Any] | None = None
    quantize_blocks: Callable[..., None] | None = None
    # Sparse attention (``sinkserve_kernels/block_sparse.py``): block_sparse_attention(query, kv, bounds, block_tables,
    # seq_lens, query_start_loc, plan, scale) over 16-bit or quantized KV. Both backends share the block
    # selection (so their selections are identical); they differ in the attention over it.
    block_sparse_attention: Callable[..., Any] | None = None
    # The trained indexer's token-sparse attention (``sinkserve_kernels/indexed_sparse.py``): indexed_sparse_attention(
    # query, kv, idx_q, idx_w, index_cache, block_tables, seq_lens, query_start_loc, plan, scale).
    indexed_sparse_attention: Callable[..., Any] | None = None
    # plan(block_tables, seq_lens, query_start_loc, block_size, window) -> what paged_attention(_quant) derive from
    # the step's metadata (gather indices, masks), built once per forward and passed to every layer as
    # ``plan=``; None: the backend takes no plan.
    plan: Callable[..., Any] | None = None


def torch_backend() -> AttentionBackend:
    from sinkserve_kernels import block_sparse as bs
    from sinkserve_kernels import indexed_sparse as ix
    from sinkserve_kernels import torch_kernels

    return AttentionBackend("torch", torch_kernels.write_kv, torch_kernels.paged_attention,
                            write_kv_quant=torch_kernels.write_kv_quant,
                            paged_attention_quant=torch_kernels.paged_attention_quant,
                            quantize_blocks=torch_kernels.quantize_fp_slots, plan=torch_kernels.plan_attention,
                            block_sparse_attention=functools.partial(
                                bs.block_sparse_attention, attend=bs.attend_gather,
                                paged=bs.PagedDecode(torch_kernels.paged_attention, torch_kernels.paged_attention_quant)),
                            indexed_sparse_attention=functools.partial(ix.indexed_sparse_attention,
                                                                       select=ix.select_torch, attend=ix.attend_torch))


def cpu_backend() -> AttentionBackend:
    """The reference with one-token queries attended by ``sinkserve_kernels/cpu_attention.py``'s C kernel; the
    plain ``torch`` backend when that kernel cannot be built here (it logs why)."""
    from sinkserve_kernels import cpu_attention as ca
    from sinkserve_kernels import cpu_ops

    base = torch_backend()
    if ca.load() is None:
        return base
    from sinkserve_kernels import block_sparse as bs

    # Sparse decode tokens attend their selected blocks through the C kernel too (no per-sequence gather).
    sparse = functools.partial(bs.block_sparse_attention, attend=bs.attend_gather,
                               paged=bs.PagedDecode(ca.paged_attention, ca.paged_attention_quant))
    return dataclasses.replace(base, name="cpu", write_kv=cpu_ops.write_kv, paged_attention=ca.paged_attention,
                               write_kv_quant=cpu_ops.write_kv_quant, paged_attention_quant=ca.paged_attention_quant,
                               plan=ca.plan, block_sparse_attention=sparse)


def triton_backend() -> AttentionBackend:
    """The Triton ``write_kv`` and ``paged_attention`` (reference signatures), and ``warm_up``, which
    compiles every configuration they can launch for a model shape (CUDA only). Without CUDA the kernels
    run in Triton's interpreter (``sinkserve_kernels._triton`` sets ``TRITON_INTERPRET=1``): exact, but slow."""
    from sinkserve_kernels import kv_quant as kq
    from sinkserve_kernels import paged_attention as pa
    from sinkserve_kernels import sparse_attention as sa
    from sinkserve_kernels import triton_warm_up

    from sinkserve_kernels import block_sparse as bs
    from sinkserve_kernels import indexed_sparse as ix

    return AttentionBackend("triton", pa.write_kv, pa.paged_attention, warm_up=triton_warm_up.warm_up,
                            warm_up_sparse=sa.warm_up_sparse,
                            write_kv_quant=kq.write_kv_fp, paged_attention_quant=kq.paged_attention_quant,
                            quantize_blocks=kq.quantize_fp_slots,
                            block_sparse_attention=functools.partial(bs.block_sparse_attention,
                                                                     attend=bs.attend_slots_triton),
                            indexed_sparse_attention=functools.partial(ix.indexed_sparse_attention,
                                                                       select=ix.select_triton, attend=ix.attend_triton))


# name -> zero-argument factory
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": torch_backend, "cpu": cpu_backend,
                                                        "triton": triton_backend}


class BackendError(ValueError):
    """A backend name, or a backend on a device, that this package cannot run."""


def is_cuda(device: str) -> bool:
    """Whether ``device`` names a CUDA device (``"cuda"`` or ``"cuda:N"``)."""
    return device == "cuda" or device.startswith("cuda:")


def resolve_backend(name: str, device: str) -> str:
    """``"auto"``: the Triton kernels on CUDA, the ``cpu`` backend (the torch reference with a C decode
    attention kernel, ``sinkserve_kernels/cpu_attention.py``) anywhere else. Follows the configured device,
    never the machine: ``device="cpu"`` on a GPU host must not get GPU kernels."""
    if name != "auto":
        return name
    return "triton" if is_cuda(device) else "cpu"


def available_backends() -> list[str]:
    return sorted(BACKENDS)


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """The backend ``name`` (``"auto"`` follows ``device``, not the machine); an unknown name, or Triton on a
    CPU device where Triton compiles for CUDA, is a :class:`BackendError` that says what to use instead."""
    name = resolve_backend(name, device)
    if name not in BACKENDS:
        raise BackendError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    backend = BACKENDS[name]()
    if name == "triton" and not is_cuda(device):
        # On a CUDA host Triton compiles for the GPU and its launchers refuse CPU tensors, so an engine left at
        # device="cpu" would load its weights and fail at the first step; say so before anything loads.
        # (Imported after the backend: importing sinkserve_kernels._triton is what sets the interpreter on a CPU host.)
        from sinkserve_kernels import _triton

        if not _triton.interpreting():
            raise BackendError(f"'triton' on device {device!r} runs only in Triton's CPU interpreter "
                               "(TRITON_INTERPRET=1); this host compiles Triton for CUDA: use device='cuda' with "
                               "attention_backend 'triton', or 'cpu' / 'torch' on device 'cpu'")
    return backend
