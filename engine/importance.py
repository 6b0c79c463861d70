"""The runner's side of ``importance`` eviction: how much attention each cached block receives.

Per layer and scheduled sequence, the step's last ``OBSERVATION_QUERIES`` queries (all of a decode step's
one query; a prefill chunk's tail, as SnapKV's observation window) attend over the sequence's held
blocks; the mass each block receives, averaged over query heads and those queries, is added to an
accumulator ``[S, table_width]`` (summed over layers). The engine folds each step's row into the
sequence's running totals (``retention.accumulate_importance``, pure Python) and the scheduler evicts the
lowest. Worked example (block_size 4, one head, a decode query at position 9, block 1 evicted)::

    logical block:   0          1 (null)   2
    tokens:          0..3       --         8, 9
    softmax mass:    .1 .1 .1 .1            .2 .4     -> block mass [0.4, 0.0, 0.6]

Costs one extra ``q . k`` over the held keys per layer (the budget bounds it), on any backend: keys are
read with ``block_sparse.gather_blocks`` (plain or quantized caches). A decode step on the C step
(``kernels/cpu_decode.py``) computes the same masses in C (``csrc/decode_step.c`` ``block_mass``) into the
same accumulator; this function is its reference (``tests/test_importance_c_step.py``).
"""

from __future__ import annotations

import torch

from kernels.block_sparse import gather_blocks

OBSERVATION_QUERIES = 32


def accumulate(acc: torch.Tensor, q: torch.Tensor, kv: object, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, block_size: int) -> None:
    """Add this layer's per-block attention mass of each sequence's observation queries to ``acc [S, W]``.

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
        mass = logits.softmax(-1).mean(dim=(0, 1, 2))  # [m * bs]
        acc[i].index_add_(0, held, mass.view(m, bs).sum(1))
