"""Per-request failure boundaries inside a step.

A step serves many requests at once; the work that belongs to one of them -- its logits processing,
grammar mask, sampling, detokenization -- runs inside a boundary. An exception there fails that
request alone (it finishes with ``finish_reason == "error"``, its blocks are freed, its client gets
an error naming it) while the step and every other request go on. What is not per request (the
forward, the block manager) is outside any boundary: its failure is the engine's.

    step:  forward (all requests) -> sample rows ---------------------> deltas
                                       | row r3: logits processing raises
                                       v
                                     failures["r3"] = "logits processing: ValueError: ..."
                                       -> r3 finishes "error", r1, r2, r4 get their tokens
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

ERROR_FINISH = "error"  # finish_reason of a request that failed inside the engine


class RequestFailures(dict[str, str]):
    """``request_id -> reason`` of the requests that failed during one step (the first reason wins)."""

    @contextmanager
    def guard(self, request_id: str, stage: str) -> Iterator[None]:
        """Run the block as ``request_id``'s ``stage``; an exception fails that request, not the caller.

        >>> f = RequestFailures()
        >>> with f.guard("r1", "sampling"):
        ...     raise ValueError("bad row")
        >>> f
        {'r1': 'sampling failed: ValueError: bad row'}
        """
        try:
            yield
        except Exception as e:  # noqa: BLE001 - the boundary: one request's failure stays its own
            logger.exception("request %s: %s failed", request_id, stage)
            self.setdefault(request_id, f"{stage} failed: {type(e).__name__}: {e}")
