"""Input processing: a request (prompt, sampling, anchors) becomes a validated ``Sequence``.

Everything that can refuse a request happens here, before it reaches the scheduler: token ids are
checked against the vocabulary, the prompt against the engine's limit (``EngineLimits.max_seq_len``:
``max_model_len``, or ``max_stream_tokens`` when the policy evicts or runs selected memory), the protection set against ``max_protected_tokens``.
Each refusal is an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq
from typing import Any

from engine.memory import retention
from engine.cache_policy import CachePolicy, check_block_budget
from engine.limits import EngineLimits
from engine.errors import ConfigError, InvalidRequestError, PromptTooLongError, ProtectionCapError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.core.tokenization import role_delimiter_ids, tokenize_text

# A token range ``(start, end)`` or ``{"start": s, "end": e}``, or ``{"text": "..."}`` found in the prompt.
Anchor = dict[str, Any] | tuple[int, int]


class InputProcessor:
    """Tokenizes and validates requests for one engine (its tokenizer, vocabulary and limits)."""

    def __init__(self, tokenizer: Any, vocab_size: int, block_size: int, limits: EngineLimits) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.limits = limits  # the engine's own object (replaced with it on a policy change)
        # Role delimiters from the model's own chat template (tokenization.role_delimiter_ids); a BOS that is
        # also a turn delimiter (SmolLM2's <|im_start|>) counts as a delimiter.
        self.delimiter_ids = role_delimiter_ids(tokenizer)
        self.session_start_ids = {t for t in [tokenizer.bos_token_id] if t is not None} - self.delimiter_ids

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
        limit, what = self.limits.max_seq_len, self.limits.limit_field.rsplit(".", 1)[-1]
        if len(ids) >= limit:
            raise PromptTooLongError(len(ids), limit - 1, f"{what} minus one output token")
        if not policy.evicts:
            need = -(-min(len(ids) + params.max_tokens, limit) // self.block_size)
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
        """Token ranges of the anchors (``retention.resolve_anchor_spans``, the planner's resolution too)."""
        text = prompt if isinstance(prompt, str) else None
        return retention.resolve_anchor_spans(
            anchors, len(ids), text, lambda: self.tokenizer(text, return_offsets_mapping=True)["offset_mapping"])

    def system_span(self, ids: list[int]) -> tuple[int, int] | None:
        """The first chat turn if its role is ``system``: from the start to its closing delimiter (the role
        delimiters come from the model's chat template: ``tokenization.role_delimiter_ids``)."""
        opens = [i for i, t in enumerate(ids) if t in self.delimiter_ids]
        if len(opens) < 2:
            return None
        head = self.tokenizer.decode(ids[opens[0] + 1 : min(opens[1], opens[0] + 9)])  # the role name, any tokenizer
        return (0, opens[1] + 1) if head.lstrip().startswith("system") else None
