"""The ``cpu`` backend's C decode-attention kernel against the torch reference (``kernels/reference.py``)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_attention, reference
from kernels.backend import BACKENDS
from tests.kernels.kernel_cases import check, make_batch

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler: the cpu backend is the reference")


def _both(b, window=None, sinks=None, plan=None):
    scale = b.query.shape[-1] ** -0.5
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    ref = reference.paged_attention(*args, window=window, sinks=sinks)
    out = cpu_attention.paged_attention(*args, window=window, sinks=sinks, plan=plan)
    return out, ref


@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_decode_only_matches_reference(heads, window):
    """One token per sequence, null blocks in the tables, GQA groups 2 / 8 / 1, full and sliding layers."""
    hq, hkv = heads
    b = make_batch([1] * 5, [1, 17, 48, 70, 130], hq, hkv, 32, block_size=16, seed=hq * 10 + (window or 0))
    out, ref = _both(b, window=window)
    check("cpu decode_attention", out, ref, torch.float32)


def test_sinks_and_empty_window():
    """Learned sinks in the denominator; a query whose window holds only a null block sees no key -> zeros."""
    b = make_batch([1, 1, 1], [9, 40, 64], 4, 2, 16, block_size=8, seed=3)
    b.block_tables[1, 4] = 0  # seq 1's last block (positions 32..39) evicted: window 3 sees nothing
    sinks = torch.randn(4)
    out, ref = _both(b, sinks=sinks)
    check("cpu decode_attention sinks", out, ref, torch.float32)
    out, ref = _both(b, window=3, sinks=sinks)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    check("cpu decode_attention sinks", out, ref, torch.float32)


def test_mixed_step_and_strided_query():
    """Prefill chunks beside decodes (the reference fills their rows), queries a strided view of q|k."""
    b = make_batch([1, 7, 1, 20, 1], [33, 7, 90, 52, 5], 4, 2, 32, block_size=16, seed=7)
    qk = torch.cat([b.query, torch.randn(b.query.shape[0], 2, 32)], dim=1)
    b.query = qk[:, :4]
    assert not b.query.is_contiguous()
    block_size = b.block_size
    plan = cpu_attention.plan(b.block_tables, b.seq_lens, b.query_start_loc, block_size)
    assert not plan.decode_only
    out, ref = _both(b, plan=plan)
    check("cpu decode_attention mixed", out, ref, torch.float32)


def test_non_float32_falls_back_to_reference():
    b = make_batch([1, 1], [20, 35], 4, 2, 32, dtype=torch.bfloat16)
    out, ref = _both(b)
    assert torch.equal(out, ref)


def test_auto_backend_on_cpu_is_the_cpu_backend():
    backend = BACKENDS["cpu"]()
    assert backend.name == "cpu" and backend.plan is cpu_attention.plan
