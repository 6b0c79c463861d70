"""Output processing: a sampled token becomes a ``RequestOutput`` delta.

Per request it keeps the incremental detokenizer (stop strings) and the prompt log-probs waiting for
the first sampled token; per token it decides whether the request finishes (EOS, stop token or string,
``max_tokens``, the engine's length limit) and protects generated delimiters when the policy says so.
"""

from __future__ import annotations

from typing import Any

from engine.limits import EngineLimits
from engine.cache_policy import CachePolicy
from engine.core.detokenizer import IncrementalDetokenizer, Tail
from engine.outputs import RequestOutput
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence
from engine.core.stats import EngineCounters


class OutputProcessor:
    """Turns step results into deltas; finishes requests through the scheduler (which frees blocks)."""

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: set[int],
        delimiter_ids: set[int],
        block_size: int,
        limits: EngineLimits,
        scheduler: Scheduler,
        counters: EngineCounters,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.delimiter_ids = delimiter_ids
        self.block_size = block_size
        self.limits = limits  # the engine's own object (replaced with it on a policy change)
        self.scheduler = scheduler
        self.counters = counters
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._pending_prompt_lps: dict[str, list[float]] = {}

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is registered and not finished yet (ids must be unique while live)."""
        return request_id in self._detoks

    def register(self, seq: Sequence) -> None:
        self._detoks[seq.request_id] = IncrementalDetokenizer(self.tokenizer, tuple(seq.params.stop))

    def prompt_logprobs(self, seq: Sequence, lps: list[float], samples: bool) -> RequestOutput | None:
        """Prompt log-probs of a chunk: a delta now when nothing is sampled from this chunk, else they
        ride on the first sampled token's delta."""
        if samples:
            self._pending_prompt_lps[seq.request_id] = lps
            return None
        return self.output(seq, [], None, finished=False, prompt_logprobs=lps)

    def on_token(self, seq: Sequence, tok: int, lp: float, policy: CachePolicy,
                 top: list[tuple[int, float]] | None = None) -> RequestOutput:
        """``tok`` was appended to ``seq``: count it, check stops, detokenize, and return its delta."""
        c = self.counters
        seq.output_logprobs.append(lp)
        c.generation_tokens_total += 1
        c.nll_sum -= lp
        c.nll_count += 1
        if tok in self.delimiter_ids and "delimiter" in policy.protected_token_roles:
            self._protect_generated(seq, seq.num_tokens - 1, policy)
        reason = self._finish_reason(seq, tok, policy)
        detok = self._detoks[seq.request_id]
        text = detok.update(Tail(seq.token_ids, seq.num_prompt_tokens), finished=reason is not None)
        if detok.stopped and reason is None:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self.output(seq, [tok], lp, finished=reason is not None, text=text,
                           prompt_logprobs=self._pending_prompt_lps.pop(seq.request_id, None), top=top)

    def _protect_generated(self, seq: Sequence, position: int, policy: CachePolicy) -> None:
        if len(seq.protected_positions) < policy.max_protected_tokens:
            seq.protected_positions.append(position)
            seq.protected_blocks.add(position // self.block_size)
            self.counters.tokens_protected_total += 1

    def _finish_reason(self, seq: Sequence, tok: int, policy: CachePolicy) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.limits.max_seq_len:
            return "length"
        return None

    def output(
        self,
        seq: Sequence,
        toks: list[int],
        lp: float | None,
        finished: bool,
        text: str = "",
        prompt_logprobs: list[float] | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> RequestOutput:
        """The delta for ``seq``; a finished one releases the request's per-request state."""
        if finished:
            self._detoks.pop(seq.request_id, None)
            self._pending_prompt_lps.pop(seq.request_id, None)
            self.counters.requests_finished_total += 1
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=toks,
            logprobs=[lp] if (seq.params.logprobs and lp is not None) else None,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            top_logprobs=[top] if (seq.params.logprobs and top is not None) else None,
        )
