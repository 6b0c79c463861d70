"""The runner's side of ``importance`` eviction: how much attention each cached block receives.

Per layer and scheduled sequence, the step's last ``OBSERVATION_QUERIES`` queries (all of a decode step's
one query; a prefill chunk's tail, as SnapKV's observation window) attend over the sequence's held
blocks. Each query head's mass per block (averaged over those queries) is pooled by the **max over the
layer's query heads**, and written to that layer's row of an accumulator ``[L, S, table_width]``; the
runner sums the layers (``pool_layers``). The engine folds each step's row into the sequence's running
totals (``retention.accumulate_importance``, pure Python) and the scheduler evicts the lowest.

Why the max: a paged cache evicts a block for every head at once, and a fact is usually read by a few
retrieval heads while the rest look elsewhere; the mean over heads diluted those few. On SmolLM2-135M
(question in view, 25 % budget, 12 documents of real prose) the mean kept 7/12 facts and the max 12/12,
with long-stream perplexity and the reference model's needle unchanged (docs/importance_reduce.md).

Worked example (block_size 4, two heads, a decode query at position 9, block 1 evicted)::

    logical block:   0             1 (null)   2
    tokens:          0..3          --         8, 9
    head 0 mass:     .1 .1 .1 .1              .2 .4     -> per block [0.4, 0.0, 0.6]
    head 1 mass:     .0 .0 .0 .9              .0 .1     -> per block [0.9, 0.0, 0.1]
    layer's score (max over heads)                      ->           [0.9, 0.0, 0.6]

Under tensor parallelism each rank holds some heads: the per-layer rows are all-reduced with MAX before
the layers are summed, so every rank gets TP=1's scores. Costs one extra ``q . k`` over the held keys per
layer (the budget bounds it), on any backend: keys are read with ``block_sparse.gather_blocks`` (plain or
quantized caches). A decode step on the C step (``sinkserve_kernels/cpu_decode.py``) computes the same scores in C
(``csrc/decode_step.c`` ``block_mass``), the layers already summed into row 0 of the accumulator; this
module is its reference (``tests/test_importance_c_step.py``).
"""

from __future__ import annotations

import torch

from sinkserve_kernels.block_sparse import gather_blocks

OBSERVATION_QUERIES = 32


def accumulate(acc: torch.Tensor, q: torch.Tensor, kv: object, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, block_size: int) -> None:
    """Raise this layer's row ``acc [S, W]`` to each block's largest per-head attention mass from each
    sequence's observation queries (the row starts at zero: one call per layer).

    ``q [T, Hq, D]`` are the step's packed queries (already RoPE'd, as stored keys are).
    """
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        n_q = starts[i + 1] - starts[i]
        if n_q == 0:
            continue
        nb = -(-seq_len // block_size)
        row = block_tables[i, :nb]
        held = (row != 0).nonzero().flatten()
        if held.numel() == 0:
            continue
        keys, _ = gather_blocks(kv, row.index_select(0, held).long(), torch.float32)  # [m, bs, Hkv, D]
        m, bs, hkv, d = keys.shape
        keys = keys.reshape(m * bs, hkv, d)
        pos = (held[:, None] * block_size + torch.arange(bs, device=held.device)).flatten()  # [m * bs]
        obs = min(n_q, OBSERVATION_QUERIES)
        qs = q[starts[i + 1] - obs : starts[i + 1]].float()  # [o, Hq, D]
        qs = qs.view(obs, hkv, -1, d)  # grouped-query: query head h reads KV head h // group
        logits = torch.einsum("ohgd,khd->hgok", qs, keys) * scale
        qpos = seq_len - obs + torch.arange(obs, device=held.device)
        hidden = (pos[None, :] > qpos[:, None]) | (pos[None, :] >= seq_len)  # causal + the last block's tail
        logits.masked_fill_(hidden, float("-inf"))
        per_head = logits.softmax(-1).mean(dim=2).reshape(-1, m, bs).sum(-1)  # [Hq, m]: each head's block mass
        acc[i].index_copy_(0, held, torch.maximum(acc[i].index_select(0, held), per_head.amax(0)))


def pool_layers(acc: torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """``[L, S, W]`` per-layer scores -> ``[S, W]``, summed over layers; under tensor parallelism the rows are
    first all-reduced with MAX (each rank pooled only its own heads), so every rank sums TP=1's rows."""
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(acc, op=dist.ReduceOp.MAX)
    return acc.sum(0)
