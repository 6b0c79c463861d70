"""A compiled decode step: ``torch.compile`` (inductor) of the native forward at bucketed batch sizes.

Decode-only steps (one new token per sequence) are padded up to the next bucket, so the compiled graphs
see a handful of fixed shapes, all compiled at start-up (``warm_up``), never under a request::

    buckets (max_num_seqs 48): 1 2 4 8 16 32 48
    a decode step of 5 sequences runs the bucket-8 graph: rows 5..7 are padding (slot -1: their keys
    and values are written nowhere, attention reads only the 5 real rows, their logits are dropped)

The attention call stays outside the graphs (``torch.compiler.disable``): it is the engine's shared
entry point with data-dependent Python (paged metadata, quantized gathers), and everything around it
(norms, fused projections, RoPE, SiLU, residuals) is what the compiler fuses. Prefill and mixed steps
run eagerly. Inductor keeps compiled kernels in its on-disk cache (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``), so a second start compiles from cache.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself.

    >>> decode_buckets(48)
    (1, 2, 4, 8, 16, 32, 48)
    """
    return tuple(b for b in POWERS if b < max_num_seqs) + (max_num_seqs,)


class CompiledDecode:
    """The compiled ``forward(input_ids, positions, logits_indices)`` of a step module, one graph per bucket."""

    def __init__(self, model: torch.nn.Module, buckets: tuple[int, ...]) -> None:
        import torch._dynamo

        self.buckets = buckets
        # Attention stays eager (graph breaks around it); set on the instance so an uncompiled model pays nothing.
        model.attend = torch.compiler.disable(type(model).attend)
        # One graph per bucket and per graph-break segment; never recompile past that.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(buckets) + 2)
        self.fn = torch.compile(model.forward, dynamic=False)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens`` rows, or None when the step is larger than all."""
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[i] if i < len(self.buckets) else None

    def warm_up(self, run_decode: Callable[[int], None]) -> float:
        """Compile every bucket (``run_decode(batch)`` runs one decode step of that size); seconds taken."""
        t0 = time.perf_counter()
        for b in self.buckets:
            run_decode(b)
        return time.perf_counter() - t0
