"""Input processing: a request (prompt, sampling, anchors) becomes a validated ``Sequence``.

Everything that can refuse a request happens here, before it reaches the scheduler: token ids are
checked against the vocabulary, the prompt against the engine's limit (``max_model_len``, or
``max_stream_tokens`` when the policy evicts), the protection set against ``max_protected_tokens``.
Each refusal is an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq
from typing import Any

from engine import retention
from engine.cache_policy import CachePolicy, check_block_budget
from engine.errors import ConfigError, InvalidRequestError, PromptTooLongError, ProtectionCapError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenization import tokenize_text

# A token range ``(start, end)`` or ``{"start": s, "end": e}``, or ``{"text": "..."}`` found in the prompt.
Anchor = dict[str, Any] | tuple[int, int]


class InputProcessor:
    """Tokenizes and validates requests for one engine (its tokenizer, vocabulary and limits)."""

    def __init__(self, tokenizer: Any, vocab_size: int, block_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.session_start_ids = {t for t in [tokenizer.bos_token_id] if t is not None}
        self.delimiter_ids = specials - self.session_start_ids - {tokenizer.pad_token_id, tokenizer.unk_token_id}

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of ``prompt``; validates ids given directly."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return tokenize_text(self.tokenizer, prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return ids

    def process(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        anchors: Iterable[Anchor],
        policy: CachePolicy,
        num_kv_blocks: int,
        arrival: int,
    ) -> Sequence:
        """Validate the request under ``policy`` and build its ``Sequence`` with its protected positions."""
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt)
        limit, what = (policy.max_stream_tokens, "max_stream_tokens") if policy.evicts else (self.max_model_len, "max_model_len")
        if len(ids) >= limit:
            raise PromptTooLongError(len(ids), limit - 1, f"{what} minus one output token")
        if not policy.evicts:
            need = -(-min(len(ids) + params.max_tokens, self.max_model_len) // self.block_size)
            if need > num_kv_blocks - 1:
                raise PromptTooLongError(len(ids), (num_kv_blocks - 1) * self.block_size, "KV cache capacity")
        protected = retention.resolve_protected_positions(
            ids,
            policy,
            delimiter_ids=self.delimiter_ids,
            session_start_ids=self.session_start_ids,
            system_span=self.system_span(ids) if "system" in policy.protected_token_roles else None,
            anchor_spans=self.anchor_spans(prompt, ids, anchors),
        )
        if len(protected) > policy.max_protected_tokens:
            raise ProtectionCapError(len(protected), policy.max_protected_tokens)
        seq = Sequence(request_id, ids, params, arrival=arrival, protected_positions=protected)
        seq.protected_blocks = retention.blocks_of(protected, self.block_size)
        seq.block_budget = self._block_budget(params, policy)
        return seq

    def _block_budget(self, params: SamplingParams, policy: CachePolicy) -> int | None:
        """The request's own block budget (``kv_budget_blocks``), checked against the pool's policy."""
        budget = params.kv_budget_blocks
        if budget is None:
            return None
        if policy.eviction_policy != "importance":
            raise InvalidRequestError("kv_budget_blocks", "needs a pool with eviction_policy 'importance' (this pool "
                                      f"uses {policy.eviction_policy!r})")
        if budget > policy.block_budget:
            raise InvalidRequestError("kv_budget_blocks", f"at most the pool's block_budget {policy.block_budget}, got {budget}")
        try:
            check_block_budget(budget, policy.window, self.block_size, "kv_budget_blocks")
        except ConfigError as e:
            raise InvalidRequestError("kv_budget_blocks", e.message) from None
        return budget

    def anchor_spans(self, prompt: str | Seq[int], ids: list[int], anchors: Iterable[Anchor]) -> list[tuple[int, int]]:
        """Token ranges of the anchors: ``(start, end)`` token ranges, or ``{"text": ...}`` found in the prompt."""
        spans = []
        offsets = None
        for i, a in enumerate(anchors):
            if isinstance(a, dict) and "text" in a:
                if not isinstance(prompt, str):
                    raise InvalidRequestError(f"anchors[{i}]", "text anchors need a text prompt")
                if offsets is None:
                    offsets = self.tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]
                    if len(offsets) == len(ids) + 1:  # the tokenizer's BOS that tokenize() dropped
                        offsets = offsets[1:]
                span = retention.text_anchor_span(prompt, a["text"], offsets)
                if span is None:
                    raise InvalidRequestError(f"anchors[{i}].text", "anchor text does not occur in the prompt")
                spans.append(span)
                continue
            start, end = (a["start"], a["end"]) if isinstance(a, dict) else a
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(ids)):
                raise InvalidRequestError(f"anchors[{i}]", f"token range must satisfy 0 <= start < end <= {len(ids)}")
            spans.append((start, end))
        return spans

    def system_span(self, ids: list[int]) -> tuple[int, int] | None:
        """The first chat turn if its role is ``system``: from its opening delimiter to its closing one."""
        opens = [i for i, t in enumerate(ids) if t in self.delimiter_ids]
        if len(opens) < 2:
            return None
        head = self.tokenizer.decode(ids[opens[0] + 1 : opens[0] + 4])
        return (0, opens[1] + 1) if head.lstrip().startswith("system") else None
