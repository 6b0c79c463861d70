"""Attention backends: the kernel entry points the engine calls, one set per backend.

A backend is two pure functions over the paged layout (``sinkserve_kernels/layout.py``):

    write_kv(key, value, k_cache, v_cache, slot_mapping)            -> None (in place)
    paged_attention(query, k_cache, v_cache, block_tables,
                    seq_lens, query_start_loc, scale,
                    window=None, sinks=None)                        -> [T, Hq, D]

``window`` (a sliding-window layer's width) and ``sinks`` (``[Hq]`` learned sink logits) are per layer
and keyword arguments of every attention entry point (``sinkserve_kernels/reference.py`` defines them).

``torch`` (``sinkserve_kernels/reference.py``) is the exact reference and runs everywhere; ``cpu``
(``sinkserve_kernels/cpu_attention.py``) is the reference with its decode attention in a small C kernel (what
``auto`` picks on CPU; the reference when no C compiler is there); ``triton`` runs the
Triton kernels (CUDA, or the CPU interpreter with ``TRITON_INTERPRET=1``), imported only when asked
for, so a CPU install never needs a working Triton compiler. A backend may also supply
``warm_up(shapes)``: compile every kernel configuration its launchers can pick for the engine's model,
so no request pays a JIT compile.
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
    from sinkserve_kernels import reference

    return AttentionBackend("torch", reference.write_kv, reference.paged_attention,
                            write_kv_quant=reference.write_kv_quant,
                            paged_attention_quant=reference.paged_attention_quant,
                            quantize_blocks=reference.quantize_fp_slots, plan=reference.plan_attention,
                            block_sparse_attention=functools.partial(
                                bs.block_sparse_attention, attend=bs.attend_gather,
                                paged=bs.PagedDecode(reference.paged_attention, reference.paged_attention_quant)),
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

    from sinkserve_kernels import block_sparse as bs
    from sinkserve_kernels import indexed_sparse as ix

    return AttentionBackend("triton", pa.write_kv, pa.paged_attention, warm_up=pa.warm_up,
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
