"""Per-request sampling settings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_N = 8
MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 300  # entries; OpenAI documents no cap, an unbounded map would be a cheap DoS


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the sampled tokens must follow (``engine/worker/grammar.py`` compiles it with xgrammar).

    ``kind`` is ``"json_object"`` (any JSON object) or ``"json_schema"`` (``schema``: the JSON schema,
    serialized, so the params stay hashable and cheap to pickle).
    """

    kind: str
    schema: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (below 1e-5) is greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters. The same
    ``seed`` gives the same output for the same prompt. Penalties, ``logit_bias`` and
    ``structured_output`` change the logits the token is chosen from (greedy included); reported
    log-probabilities stay those of the model's raw distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    ignore_eos: bool = False
    # Teacher-forced scoring: stream the log-probability of every prompt token given its prefix.
    prompt_logprobs: bool = False
    # Choices per request. The engine runs one sequence per request; callers fan out (app/pool/server.py).
    n: int = 1
    # Alternatives reported with each sampled token's log-prob (0: none).
    top_logprobs: int = 0
    # OpenAI's additive penalties (on output-token counts) and HF/vLLM's multiplicative one (on
    # every token seen, prompt included; 1 disables).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to the logits before the choice.
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None
    # Retention, carried with the request: under ``eviction_policy: importance`` this request holds at most
    # this many KV blocks (at most the pool's ``block_budget``; checked by the input processor). None: the
    # pool's budget.
    kv_budget_blocks: int | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the field of the first invalid value."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"token ids must be in [0, {vocab_size})")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        # Bounded below: a logit divided by a denormal is inf, and the softmax of inf is NaN.
        if not (isinstance(r, (int, float)) and 0.01 <= r <= 10.0):
            raise InvalidRequestError("repetition_penalty", f"must be in [0.01, 10], got {r!r}")
        self._validate_logit_bias(vocab_size)
        if self.kv_budget_blocks is not None and (not isinstance(self.kv_budget_blocks, int) or self.kv_budget_blocks < 1):
            raise InvalidRequestError("kv_budget_blocks", f"must be an integer >= 1, got {self.kv_budget_blocks!r}")
        if self.structured_output is not None:
            validate_structured_output(self.structured_output)

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise InvalidRequestError("logit_bias", f"token ids must be integers {bound}, got {tok!r}")
            if not (isinstance(bias, (int, float)) and math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError("logit_bias", f"biases must be in [-100, 100], got {bias!r} for token {tok}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and the softmax to NaN (vLLM uses the same cut).
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the sampler must track this request's token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def validate_structured_output(so: StructuredOutput) -> None:
    """Refuse a grammar xgrammar cannot build, naming the request field (before any token is spent)."""
    if so.kind == "json_object":
        return
    if so.kind != "json_schema":
        raise InvalidRequestError("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {so.kind!r}")
    try:
        schema = json.loads(so.schema or "")
    except ValueError as e:
        raise InvalidRequestError("response_format.json_schema.schema", f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema", "must be a JSON object")
    import xgrammar  # lazily: only structured requests pay for it

    try:
        xgrammar.Grammar.from_json_schema(so.schema, any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses for unsupported schemas
        raise InvalidRequestError("response_format.json_schema.schema", f"unsupported JSON schema: {e}") from None
