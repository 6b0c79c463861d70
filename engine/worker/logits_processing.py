"""Per-request logits shaping on the sampling device: penalties, logit bias and grammar masks.

Batched over the step's sampling rows: one gather of the penalized rows' token counts, one
``index_put_`` for every bias, one packed bitmask for every grammar. Per-request state (token counts,
grammar matchers) lives here, keyed by request id, from a request's first sampled token until it is
released; it is fed the tokens the sampler chose, so nothing per step grows with the output.

Penalties follow OpenAI and vLLM: ``frequency_penalty * count + presence_penalty * (count > 0)`` is
subtracted for tokens already *generated*; ``repetition_penalty`` (HF/vLLM) divides positive and
multiplies negative logits of every token already *seen* (prompt or output).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.worker.grammar import GrammarBackend
from engine.isolation import RequestFailures
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LogitsProcessing:
    """Token counts in a slot table ``[slots, V]`` on ``device`` and one grammar matcher per request."""

    def __init__(self, device: torch.device, grammar: GrammarBackend) -> None:
        self.device = device
        self.grammar = grammar
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # int32 [slots, V]: generated-token counts
        self._seen: torch.Tensor | None = None  # bool [slots, V]: prompt tokens (repetition penalty)
        self._matchers: dict[str, Any] = {}

    @staticmethod
    def needed(params: Iterable[SamplingParams]) -> bool:
        return any(p.penalized or p.logit_bias or p.structured_output is not None for p in params)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            slot = self._slots.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
            self._matchers.pop(rid, None)

    @property
    def num_states(self) -> int:
        return len(self._slots) + len(self._matchers)

    # ---- state -----------------------------------------------------------------------------------

    def _slot(self, request_id: str, prompt_ids: Sequence[int], vocab: int) -> int:
        slot = self._slots.get(request_id)
        if slot is not None:
            return slot
        if self._counts is None or self._counts.shape[1] != vocab:
            self._counts = torch.zeros(8, vocab, dtype=torch.int32, device=self.device)
            self._seen = torch.zeros(8, vocab, dtype=torch.bool, device=self.device)
            self._free = list(range(8))
            self._slots.clear()
        if not self._free:  # grow the table by doubling
            old = self._counts.shape[0]
            self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
            self._seen = torch.cat([self._seen, torch.zeros_like(self._seen)])
            self._free = list(range(old, 2 * old))
        slot = self._slots[request_id] = self._free.pop()
        assert self._seen is not None
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        if prompt_ids:
            self._seen[slot, torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)] = True
        return slot

    def _matcher(self, request_id: str, params: SamplingParams, vocab: int) -> Any:
        m = self._matchers.get(request_id)
        if m is None:
            assert params.structured_output is not None
            m = self._matchers[request_id] = self.grammar.matcher(params.structured_output, vocab)
        return m

    # ---- per step ----------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
              prompt_ids: Sequence[Sequence[int]], failures: RequestFailures | None = None) -> torch.Tensor:
        """Shaped copy of ``logits [B, V]`` (row ``i`` is ``request_ids[i]``'s next token). A request whose
        own state (penalty slot, bias, grammar matcher or mask) raises is recorded in ``failures`` and its
        row is left unshaped (its token will be discarded); the other rows are shaped as usual."""
        failures = RequestFailures() if failures is None else failures
        out = logits.clone()
        dev, vocab = logits.device, logits.shape[-1]
        pen: list[int] = []
        pen_slots: list[int] = []
        for i, p in enumerate(params):
            if p.penalized:
                with failures.guard(request_ids[i], "logits processing (penalties)"):
                    pen_slots.append(self._slot(request_ids[i], prompt_ids[i], vocab))
                    pen.append(i)
        if pen:
            slots = torch.tensor(pen_slots, dtype=torch.long, device=dev)
            rows = torch.tensor(pen, dtype=torch.long, device=dev)
            assert self._counts is not None and self._seen is not None
            counts = self._counts.index_select(0, slots).to(out.dtype)
            generated = counts > 0
            seen = self._seen.index_select(0, slots) | generated
            rep = torch.tensor([params[i].repetition_penalty for i in pen], dtype=out.dtype, device=dev)[:, None]
            freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=out.dtype, device=dev)[:, None]
            pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=out.dtype, device=dev)[:, None]
            x = out.index_select(0, rows)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - freq * counts - pres * generated.to(out.dtype)
            out.index_copy_(0, rows, x)
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        for i, p in enumerate(params):
            if not p.logit_bias:
                continue
            with failures.guard(request_ids[i], "logits processing (logit_bias)"):
                row = [(int(tok), float(b)) for tok, b in p.logit_bias if tok < vocab]
                for tok, b in row:
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(b)
        if bias_rows:
            idx = (torch.tensor(bias_rows, dtype=torch.long, device=dev), torch.tensor(bias_cols, dtype=torch.long, device=dev))
            out.index_put_(idx, torch.tensor(bias_vals, dtype=out.dtype, device=dev), accumulate=True)
        live: list[tuple[int, Any]] = []
        for i, p in enumerate(params):
            if p.structured_output is None:
                continue
            with failures.guard(request_ids[i], "grammar (response_format)"):
                m = self._matcher(request_ids[i], p, vocab)
                # A terminated grammar (its document ended and EOS was accepted, yet the request goes on:
                # ``ignore_eos``) allows nothing; masking every token would leave no distribution at all.
                if not m.is_terminated():
                    live.append((i, m))
        if live:
            rows = torch.tensor([i for i, _ in live], dtype=torch.long, device=dev)
            self.grammar.apply(out, [m for _, m in live], rows, [request_ids[i] for i, _ in live], failures)
        return out

    def accept(self, request_ids: Sequence[str], params: Sequence[SamplingParams], tokens: Sequence[int],
               failures: RequestFailures | None = None) -> None:
        """Record the chosen tokens: counts of penalized requests, grammar matchers advance. Requests in
        ``failures`` are skipped (their token is a placeholder); a matcher that raises fails its request."""
        failures = RequestFailures() if failures is None else failures
        pen = [i for i, p in enumerate(params) if p.penalized and request_ids[i] in self._slots and request_ids[i] not in failures]
        if pen and self._counts is not None:
            slots = torch.tensor([self._slots[request_ids[i]] for i in pen], dtype=torch.long, device=self.device)
            toks = torch.tensor([tokens[i] for i in pen], dtype=torch.long, device=self.device)
            self._counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
        for i, p in enumerate(params):
            m = self._matchers.get(request_ids[i])
            if m is None or request_ids[i] in failures:
                continue
            with failures.guard(request_ids[i], "grammar (response_format)"):
                if not m.is_terminated() and not m.accept_token(tokens[i]):
                    logger.warning("request %s: token %d not accepted by its grammar", request_ids[i], tokens[i])
