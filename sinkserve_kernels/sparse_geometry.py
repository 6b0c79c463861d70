"""The geometry of a sparse selection, shared by the kernels and the engine's budget arithmetic. Pure Python:
no torch, so the engine's config and bookkeeping modules can import it.

Two facts live here, one definition each:

- ``PREFILL_GROUP``: how many consecutive prefill queries share one block selection (block_bounds).
- ``forced_tokens``: how many tokens a query attends whatever the indexer says, under token-granular
  selection (the trained indexer): the protected blocks' tokens plus the newest ``window`` tokens.

Worked example (block size 16, protected block 0, window 32, query at position 99)::

    positions  0 ........ 15 | 16 .......... 67 | 68 ......... 99
               protected blk |  indexer's pick  | newest 32 tokens
               16 forced     |  top_k of these  | 32 forced         -> forced_tokens = 48
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PREFILL_GROUP", "forced_tokens"]

# A prefill chunk's queries select blocks (block_bounds) in groups of this many consecutive tokens that share
# one selection: each group pays one K/V gather, mask and attention call over ~top_k + window keys, so
# larger groups share that overhead (128 vs 64: half the gathered bytes per chunk; docs/sparse_attention.md).
PREFILL_GROUP = 128


def forced_tokens(forced: Sequence[int], seq_len: int, block_size: int, window: int) -> int:
    """Forced tokens of the query at ``seq_len - 1`` under token-granular selection (the trained indexer):
    the newest ``window`` tokens plus the protected blocks' (``forced``) tokens before them.

    >>> forced_tokens([0], 100, 16, 32)   # tokens 0..15 + 68..99
    48
    """
    first_window = max(0, seq_len - window)
    extra = sum(max(0, min((b + 1) * block_size, first_window) - b * block_size) for b in forced)
    return min(seq_len, window) + extra
