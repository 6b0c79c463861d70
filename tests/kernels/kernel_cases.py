"""Input builders and error metrics shared by the kernel tests (random data, never zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative-error tolerances ||out - ref|| / ||ref|| by the kernel's input dtype.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}

# Largest relative error seen per (kernel, dtype) in this session, reported in the terminal summary.
MAX_ERRORS: dict[tuple[str, str], float] = {}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere (an unwritten poisoned element) gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def check(kernel: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> float:
    """Assert the relative error is within the dtype's tolerance and record it for the summary."""
    err = rel_err(out, ref)
    key = (kernel, str(dtype).replace("torch.", ""))
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), err)
    limit = TOL[dtype] if tol is None else tol
    assert err < limit, f"{kernel} [{dtype}]: relative error {err:.3g} >= {limit:.1g}"
    return err


@dataclass
class PagedBatch:
    """A ragged batch over a paged cache: packed queries, caches, block tables and lengths."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_size: int


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    null_blocks: bool = True,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Random caches, shuffled block tables (one spare column of zeros), null blocks punched in the middle
    of sequences with >= 3 blocks (never in the block holding the queries). Physical block 0 is filled
    with random data too, so reading the null block by mistake changes the result."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    width = max(need) + 1
    num_blocks = sum(need) + 3
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
        first_query_block = (seq_lens[s] - q_lens[s]) // block_size
        if null_blocks and n >= 3 and first_query_block > 1:
            tables[s, 1] = 0  # an evicted span
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return PagedBatch(
        q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device), block_size,
    )  # fmt: skip


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN so any element the kernel fails to write fails the comparison."""
    return torch.full_like(t, float("nan"))
