"""Selected memory past the trained context (InfLLM-style): every cached block stays, each query attends
the forced set + the indexer's top-k blocks + its local window, and the positions those keys are seen at
are re-assigned so that everything attended fits inside the model's trained context.

Turned on by ``sparse.position_mode: compact`` (``engine/worker/sparse_config.py``). The runner's side lives here:
position-free block bounds for the indexer, and attention over a selection with its keys re-positioned.

**Positions.** Keys are stored rotated at their own positions (post-RoPE), as everywhere in the engine.
For one query (group), the attended blocks are taken in logical order and made consecutive: each selected
block moves forward (towards the query) by ``block_size`` positions per visible block that was *not*
selected between it and the query. The local window is contiguous, so its keys keep their true distances;
the sinks and the selected blocks sit right before it, exactly as StreamingLLM places its sinks and
``sliding_window`` retention places anchors (``retention.rotation_shifts``), but per query and without
touching the cache: the shift is applied to the gathered copy of the keys (RoPE composes, ``R(a) R(b) =
R(a + b)``, so a stored post-RoPE key rotated by ``s`` is the key RoPE would have produced ``s`` positions
later). Worked example (block_size 4, top_k 2 blocks, local_window 10, sink block 0, decode query at 41)::

    logical block     0      1   2   3      4   5   6      7   8      9      10
    stored at         0-3            12-15          24-27      32-35  36-39  40-41   (query at 41)
    attended          S              T              T          W      W      W       S sink, T top-k, W window
    visible rank      0              3              6          8      9      10
    compact index     0              1              2          3      4      5
    gap = rank-index  0              2              4          5      5      5
    shift (tokens)    (5-0)*4=20     (5-2)*4=12     (5-4)*4=4  0      0      0
    seen at           20-23          24-27          28-31      32-35  36-39  40-41   -> 22 keys, distances 0..21

So the query at 41 attends 22 tokens that look like one contiguous 22-token context, wherever the stream
is. The longest distance any query sees is the attended span, bounded by the config (``SparseAttention.validate_compact``):
``(protected blocks + top_k / block_size + window blocks + a prefill group) * block_size`` must fit the
trained context. Blocks evicted by a retention policy (null entries) are not counted: retention already
rotated the kept blocks past them, so *visible* rank, not the logical index, is what counts.

**Cost.** One rotation of the gathered selected keys per layer and query group: ``top_k + forced`` keys,
independent of the stream's length (decode at 16x costs what it costs at 1x, plus the indexer's scan of
every block's bounds). Storing pre-RoPE keys instead would rotate *every* attended key at every step and
force RoPE into the dense paged kernels too; ``bench/selected_memory_stream.py`` measures both
(``docs/sparse_attention.md``, "Selected memory past the trained context").

**Selection is position-free.** Quest's bound ``ub(q, b)`` is only a bound on the score a key gets at the
position it is *stored* at; here the key is attended at another one (a block 15K tokens back is seen
~100 tokens back), and at the stored distance the scores come from a range RoPE was never trained on. So
in compact mode the bounds hold the min/max of the *pre-RoPE* keys (each new key rotated back by its
position once, at write time; retention rotations then need no bounds upkeep), and every candidate block
is scored with the query rotated to a fixed canonical distance ``d = local_window`` (where the nearest
selected block lands): ``q_d = R(d - p) q_p`` gives ``q_d . k0 = q_p . R(p - d) k0``, the score of a key
``d`` positions before the query. The bound is then exact for the block's keys at that distance, the
same for every block whatever its age, and the groups of a prefill chunk average canonical queries (not
queries rotated at 64 different positions). A trained indexer plugs in the same way: any ``score(q, bounds,
scale) -> [G, Hq, N]`` receives the canonical queries; it should score position-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.worker.rope import rotate_keys
from sinkserve_kernels import block_sparse as bs
from sinkserve_kernels.layout import NULL_BLOCK


def key_shifts_py(visible: list[bool], selected: list[int], block_size: int) -> list[int]:
    """Pure-Python reference of the re-positioning: the shift (in tokens) of each selected logical block,
    in ``selected``'s (sorted) order; ``visible[j]`` is False for evicted (null) blocks. The last selected
    block holds the query, so its shift is 0.

    >>> key_shifts_py([True] * 11, [0, 3, 6, 8, 9, 10], 4)
    [20, 12, 4, 0, 0, 0]
    >>> key_shifts_py([True, False, True, True, True], [0, 3, 4], 4)   # block 1 evicted: not counted
    [4, 0, 0]
    """
    rank, r = [], 0
    for v in visible:
        rank.append(r)
        r += bool(v)
    gaps = [rank[b] - i for i, b in enumerate(selected)]
    return [(gaps[-1] - g) * block_size for g in gaps]


def key_shifts(table: torch.Tensor, order: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per query group and compacted selected block (``order, valid [G, M]`` from ``block_sparse._compact``),
    the shift in tokens that makes the selection consecutive up to the group's last block (``[G, M]`` long;
    0 on padding). ``table [N]``: the sequence's physical ids (null = evicted, not counted)."""
    rank = torch.cumsum((table != NULL_BLOCK).long(), 0) - 1  # visible rank of each logical block
    idx = torch.arange(order.shape[1], device=order.device)
    gap = rank[order] - idx[None, :]
    last = (valid.sum(1) - 1).clamp(min=0)
    gap_last = gap.gather(1, last[:, None])
    return torch.where(valid, (gap_last - gap) * block_size, torch.zeros_like(gap))


def canonical_queries(q: torch.Tensor, q_pos: torch.Tensor, distance: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Queries ``[n, Hq, D]`` rotated at ``q_pos`` -> the same queries as seen by a key ``distance`` positions
    back whose bounds were taken before RoPE: ``R(distance - p) q_p``."""
    return rotate_keys(q, distance - q_pos, inv_freq)


def position_free_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """New keys ``[T, Hkv, D]`` rotated at ``positions [T]`` -> their pre-RoPE values (for the bounds)."""
    return rotate_keys(k, -positions[: k.shape[0]], inv_freq)


def attend_compact(query: torch.Tensor, q_pos: torch.Tensor, kv, table: torch.Tensor, sel: torch.Tensor, seq_len: int,
                   block_size: int, group: int, scale: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """``block_sparse.attend_gather`` with the selection re-positioned: per query group, gather its selected
    blocks, rotate each by its ``key_shifts`` and run SDPA with the causal mask of the logical positions
    (re-positioning never reorders blocks, so logical causality is compact causality).
    ``query [n, Hq, D]``, ``q_pos [n]``, ``sel [G, N]`` -> ``[n, Hq, D]``."""
    n, hq, d = query.shape
    g = sel.shape[0]
    order, valid = bs._compact(sel, block_size)
    m = order.shape[1]
    shifts = key_shifts(table, order, valid, block_size)  # [G, M]
    offs = torch.arange(block_size, device=query.device)
    pos = (order[:, :, None] * block_size + offs).flatten(1)  # [G, M*B] logical positions
    kvalid = valid.repeat_interleave(block_size, dim=1) & (pos < seq_len)
    pad = g * group - n
    qp = torch.nn.functional.pad(query, (0, 0, 0, 0, 0, pad)).view(g, group, hq, d)
    qpos = torch.cat([q_pos, q_pos[-1:].expand(pad)]).view(g, group)
    out = torch.empty(g, group, hq, d, dtype=query.dtype, device=query.device)
    hkv = (kv[0] if isinstance(kv, tuple) else kv.fp_k).shape[2]
    per_group = max(1, m * block_size * hkv * d * 2 * query.element_size())
    step = max(1, bs.MEMORY_BUDGET // per_group)
    phys = table.long()[order] * valid
    for a in range(0, g, step):
        b = min(g, a + step)
        keys, values = bs.gather_blocks(kv, phys[a:b].flatten(), query.dtype)  # [(b-a)*M, B, Hkv, D]
        keys = rotate_keys(keys, shifts[a:b].flatten(), inv_freq)
        keys = keys.view(b - a, m * block_size, hkv, d).transpose(1, 2)
        values = values.view(b - a, m * block_size, hkv, d).transpose(1, 2)
        mask = kvalid[a:b, None, :] & (pos[a:b, None, :] <= qpos[a:b, :, None])
        o = torch.nn.functional.scaled_dot_product_attention(
            qp[a:b].transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=hkv != hq)
        out[a:b] = o.transpose(1, 2)
    return out.view(g * group, hq, d)[:n]


def selected_memory_attention(query: torch.Tensor, kv, bounds: bs.BlockBounds, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: bs.SparsePlan, scale: float,
                              inv_freq: torch.Tensor, distance: int, score: bs.Score = bs.block_scores,
                              selections: list | None = None) -> torch.Tensor:
    """Attention of packed queries ``[T, Hq, D]`` over each sequence's forced + selected blocks, seen at
    compact positions (module docstring). Sequences the plan marks dense (``top_blocks < 0``) select every
    visible block, so every shift is 0 and they attend at their stored positions. ``bounds`` must hold pre-RoPE keys
    (``position_free_keys``); ``score`` receives canonical queries. ``selections`` (optional) receives each
    sequence's ``[G, N]`` selection."""
    starts = query_start_loc.tolist()
    q_pos = torch.cat([torch.arange(n - (starts[s + 1] - starts[s]), n, device=query.device)
                       for s, n in enumerate(seq_lens.tolist())])

    def attend(q: torch.Tensor, pos: torch.Tensor, kv, table: torch.Tensor, sel: torch.Tensor, seq_len: int,
               block_size: int, group: int, scale: float) -> torch.Tensor:
        return attend_compact(q, pos, kv, table, sel, seq_len, block_size, group, scale, inv_freq)

    return bs.block_sparse_attention(query, kv, bounds, block_tables, seq_lens, query_start_loc, plan, scale,
                                     attend=attend, selections=selections, score=score,
                                     score_query=canonical_queries(query[: starts[-1]].float(), q_pos, distance, inv_freq))


@dataclass(frozen=True)
class StepContext:
    """What compact mode needs in every attention layer of one forward (``ForwardContext.selected_memory``):
    each layer's RoPE table, the step's token positions, and the canonical scoring distance."""

    inv_freqs: list[torch.Tensor]
    positions: torch.Tensor  # [T] (the step's rows)
    distance: int

    def bounds_keys(self, k: torch.Tensor, layer: int) -> torch.Tensor:
        """The keys to fold into the block bounds: pre-RoPE."""
        return position_free_keys(k, self.positions, self.inv_freqs[layer])

    def attention(self, layer: int, q: torch.Tensor, kv, bounds: bs.BlockBounds, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, plan: bs.SparsePlan, scale: float,
                  score: bs.Score = bs.block_scores) -> torch.Tensor:
        return selected_memory_attention(q, kv, bounds, block_tables, seq_lens, query_start_loc, plan, scale,
                                         self.inv_freqs[layer], self.distance, score)
