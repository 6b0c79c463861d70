"""Which scheduled sequences attend sparsely this step, their forced blocks, and what they attend.

Pure Python (no torch): the engine calls ``forced_blocks`` while it builds a step's ``ModelInput`` and
``attended_tokens`` for the step's statistics; the kernels (``sinkserve_kernels/block_sparse.py``) do the scoring
and the selection on the device with the same rules.

Worked example (block_size 4, local_window 6, top_k 8 -> 2 blocks, protected position 1)::

    decode query at position 29 (seq_len 30): visible blocks 0..7 (block 3 evicted: null)
    forced   : block 0 (protected) + blocks (30 - 6) // 4 = 6 .. 7 (window)        -> {0, 6, 7}
    candidates: {1, 2, 4, 5};  the indexer picks 2 of them, say {2, 5}
    attended : blocks {0, 2, 5, 6, 7} = 5 blocks, the last holding 2 tokens -> 18 of 26 visible tokens
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.worker.sparse_config import SparseAttention
from sinkserve_kernels.sparse_geometry import forced_tokens


def applies(sparse: SparseAttention, seq_len: int, num_new_tokens: int) -> bool:
    """Whether a sequence with ``seq_len`` tokens in cache after this step (``num_new_tokens`` of them new)
    attends sparsely: sparsity on, the context at least ``min_context``, and this kind of step selected."""
    if not sparse.enabled or seq_len < sparse.min_context:
        return False
    return sparse.prefill if num_new_tokens > 1 else sparse.decode


def forced_blocks(protected_blocks: set[int] | frozenset[int], seq_len: int, block_size: int) -> list[int]:
    """The protected logical blocks that exist at ``seq_len`` tokens, sorted (the local window is added per
    query by the kernels, which know each query's position).

    >>> forced_blocks({0, 9, 3}, 30, 4)
    [0, 3]
    """
    num_blocks = -(-seq_len // block_size)
    return sorted(b for b in protected_blocks if b < num_blocks)


def attended_tokens(block_table: Seq[int], seq_len: int, forced: Seq[int] | None, sparse: SparseAttention,
                    block_size: int, num_null: int | None = None) -> tuple[int, int]:
    """``(attended, visible)`` tokens of the sequence's last query this step: ``forced`` None means dense
    (attended = visible). Exact for decode; a prefill chunk's earlier queries see a prefix of this.

    ``num_null``: how many entries of ``block_table`` are the null block (``Sequence.num_evicted_blocks``),
    if known; then a table no longer than the sequence's blocks is not scanned (only its forced and local
    window entries are read), so the engine's per-step statistics do not grow with the context.

    >>> attended_tokens([5, 6, 7, 0, 8, 9, 10, 11], 30, [0], SparseAttention(top_k=8, local_window=6), 4)
    (18, 26)
    >>> attended_tokens([5, 6, 7, 0, 8, 9, 10, 11], 30, [0], SparseAttention(top_k=8, local_window=6), 4, 1)
    (18, 26)
    """
    num_blocks = -(-seq_len // block_size)
    tail = num_blocks * block_size - seq_len  # unused slots of the last block
    if num_null is not None and num_blocks >= len(block_table):
        num_visible = len(block_table) - num_null
        visible_tokens = num_visible * block_size - tail
        if forced is None:
            return visible_tokens, visible_tokens
        if sparse.indexer == "trained":
            return min(visible_tokens, sparse.top_k + forced_tokens(forced, seq_len, block_size, sparse.local_window)), \
                visible_tokens
        first_window = max(0, seq_len - sparse.local_window) // block_size
        forced_set = {j for j in forced if j < len(block_table) and block_table[j]}
        forced_set |= {j for j in range(first_window, len(block_table)) if block_table[j]}
        selected = len(forced_set) + min(sparse.top_blocks(block_size), num_visible - len(forced_set))
        return selected * block_size - tail, visible_tokens
    visible = [j for j in range(min(num_blocks, len(block_table))) if block_table[j]]
    visible_tokens = len(visible) * block_size - tail
    if forced is None:
        return visible_tokens, visible_tokens
    if sparse.indexer == "trained":  # token granular: top_k tokens + the forced tokens of the last query
        return min(visible_tokens, sparse.top_k + forced_tokens(forced, seq_len, block_size, sparse.local_window)), \
            visible_tokens
    first_window = max(0, seq_len - sparse.local_window) // block_size
    vis = set(visible)
    forced_set = {j for j in forced if j in vis} | {j for j in visible if j >= first_window}
    candidates = len(vis) - len(forced_set)
    selected = len(forced_set) + min(sparse.top_blocks(block_size), candidates)
    return selected * block_size - tail, visible_tokens


