"""The ``cpu`` backend's C decode-attention kernel against the torch reference (``sinkserve_kernels/torch_kernels.py``)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from sinkserve_kernels import cpu_attention, torch_kernels
from sinkserve_kernels.backend import BACKENDS
from sinkserve_kernels.cpu_lib import load_source
from tests.kernels.kernel_cases import check, make_batch

pytestmark = pytest.mark.skipif(cpu_attention.load() is None, reason="no C compiler: the cpu backend is the reference")


def _both(b, window=None, sinks=None, plan=None):
    scale = b.query.shape[-1] ** -0.5
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale)
    ref = torch_kernels.paged_attention(*args, window=window, sinks=sinks)
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


# --- the kernel's builds: -march=native (AVX-512 where the CPU has it) and the portable C path ------------

SOURCE = Path(cpu_attention.__file__).parent / "csrc" / "decode_attention.c"


@functools.cache
def _lib(build: str):
    """``native``: the engine's library; ``portable``: the same source built with ``-mno-avx512f`` (the
    fallback path, the only one on a CPU without AVX-512)."""
    inc = ("-I", str(SOURCE.parent))  # decode_attention.h
    return cpu_attention.load() if build == "native" else load_source(SOURCE.read_text(), (*inc, "-mno-avx512f"))


def _call(lib, b, window=None, sinks=None, d=None) -> tuple[int, torch.Tensor]:
    """``sinkserve_decode_attention`` on a decode-only batch: (return code, out)."""
    _, hq, hd = b.query.shape
    _, block, hkv, _ = b.k_cache.shape
    tables, lens, starts = (t.to(torch.int32).contiguous() for t in (b.block_tables, b.seq_lens, b.query_start_loc))
    out = torch.full(b.query.shape, float("nan"))
    sinks = sinks.contiguous() if sinks is not None else None
    rc = lib.sinkserve_decode_attention(
        b.query.data_ptr(), b.query.stride(0), b.query.stride(1), b.k_cache.data_ptr(), b.v_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(), lens.shape[0], hq, hkv,
        hd if d is None else d, block, hd ** -0.5, window or 0, sinks.data_ptr() if sinks is not None else None,
        out.data_ptr())
    return rc, out


def _check_build(build, b, window=None, sinks=None, name="cpu decode_attention builds"):
    rc, out = _call(_lib(build), b, window, sinks)
    assert rc == 0
    ref = torch_kernels.paged_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                    b.query.shape[-1] ** -0.5, window=window, sinks=sinks)
    check(f"{name} ({build})", out, ref, torch.float32)


BUILDS = ["native", "portable"]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (6, 2), (8, 2), (5, 1), (8, 1), (16, 1), (20, 1), (40, 2)])
def test_every_group_size(build, heads):
    """GQA groups 1, 2, 3, 4, 5, 8, 16 and over 16 (20, 20: two chunks of heads, 16 + 4)."""
    hq, hkv = heads
    b = make_batch([1] * 4, [1, 16, 33, 300], hq, hkv, 32, block_size=16, seed=hq + hkv)
    _check_build(build, b, sinks=torch.randn(hq))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 96, 128, 256, 40])
def test_every_head_dim(build, head_dim):
    """The specialised 32 / 64 / 128, other multiples of 16 (48, 96, 256) and one that is not (40)."""
    b = make_batch([1] * 3, [7, 50, 129], 8, 2, head_dim, block_size=16, seed=head_dim)
    _check_build(build, b)
    _check_build(build, b, window=20, sinks=torch.randn(8))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block_size", [8, 16, 24, 32, 64])
@pytest.mark.parametrize("window", [None, 17, 500])
def test_long_contexts_across_many_blocks(build, block_size, window):
    """Hundreds of keys over many blocks, chunked within a block (24 = 16 + 8), windows starting
    mid-block, null blocks; keys that grow along the context, so the running maximum keeps rising and
    the accumulated sums are rescaled many times."""
    b = make_batch([1] * 3, [700, 1100, 45], 8, 2, 64, block_size=block_size, seed=block_size)
    b.block_tables[1, 5:9] = 0  # a longer evicted span
    b.k_cache *= torch.linspace(0.2, 3.0, b.k_cache.shape[0]).view(-1, 1, 1, 1)  # growing, in block-id order
    _check_build(build, b, window=window)
    _check_build(build, b, window=window, sinks=torch.randn(8) * 4)


@pytest.mark.parametrize("build", BUILDS)
def test_sink_above_every_score_and_empty_windows(build):
    """A sink far above the scores (weights shift almost entirely to it: the rescaled branch), and
    queries that see no key at all (zeros, sinks or not)."""
    b = make_batch([1, 1, 1], [9, 40, 200], 8, 2, 32, block_size=8, seed=5)
    b.block_tables[1, 4] = 0  # seq 1's last block evicted: window 3 sees nothing
    sinks = torch.tensor([30.0, -2.0, 0.5, 60.0, 1.0, 90.0, -50.0, 3.0])
    _check_build(build, b, sinks=sinks)
    rc, out = _call(_lib(build), b, window=3, sinks=sinks)
    assert rc == 0 and torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("build", BUILDS)
def test_peaked_scores(build):
    """Scores hundreds apart: most weights underflow (the AVX-512 exp clamps at e^-86), one key dominates."""
    b = make_batch([1, 1], [90, 333], 8, 2, 32, block_size=16, seed=11)
    b.query *= 60
    _check_build(build, b)
    _check_build(build, b, sinks=torch.randn(8) * 50)


@pytest.mark.parametrize("build", BUILDS)
def test_refused_arguments(build):
    """-2: head dim over 256; a prefill segment (longer than one token) is skipped, its rows untouched."""
    lib = _lib(build)
    b = make_batch([1, 1], [30, 70], 8, 2, 32, seed=1)
    assert _call(lib, b, window=20)[0] == 0
    assert _call(lib, b, d=257)[0] == -2
    m = make_batch([1, 3, 1, 2, 1], [30, 12, 70, 40, 5], 8, 2, 32, seed=2)
    rc, out = _call(lib, m)
    assert rc == 0 and torch.isnan(out[1:4]).all() and torch.isnan(out[5:7]).all()
    ref = torch_kernels.paged_attention(m.query, m.k_cache, m.v_cache, m.block_tables, m.seq_lens, m.query_start_loc,
                                    32 ** -0.5)
    decode_rows = [0, 4, 7]  # the one-token segments, around the prefill ones
    check(f"cpu decode_attention builds ({build})", out[decode_rows], ref[decode_rows], torch.float32)
