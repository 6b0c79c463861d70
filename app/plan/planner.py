"""Planning a request: rate check, version draw, passages trimmed to their budget
(``app/plan/passages.py``), tokenize once, bucket by length, anchors -> a typed ``RoutePlan`` (pool
deployment + ``PoolRequest``), or an ``APIError``.

The decisions are pure functions with injected inputs (token count, weights, a uniform draw, the
clock), so tests pin exact expectations; :class:`Planner` holds the only state (tokenizers, rate
buckets) and runs inside every ingress replica::

    >>> buckets = (BucketSpec("short", 2048, 60.0), BucketSpec("long", 8192, 300.0))
    >>> pick_bucket(2048, buckets).name, pick_bucket(2049, buckets).name
    ('short', 'long')
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from app.state.conversations import Conversation, chat_continuation
from app.errors import APIError
from app.events import PoolRequest, RouteInfo, RoutePlan
from app.plan.passages import Trimmed, pinned_token_ranges, trim_passages
from app.pool.prefix_affinity import prefix_key
from app.schemas import (ChatCompletionRequest, CompletionRequest, TokenizeChatRequest, TokenizeResponse, TokenRange,
                         new_request_id)
from app.settings import BucketSpec, PlanSpec, VersionSpec, pool_deployment_name
from app.plan.tools import render_tool_chat, tool_grammar, tool_mode
from engine.errors import InvalidRequestError
from engine.memory.retention import resolve_anchor_spans
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.core.tokenization import tokenize_text

Request = CompletionRequest | ChatCompletionRequest


# ---- pure decisions -----------------------------------------------------------------------------


def pick_bucket(num_tokens: int, buckets: Sequence[BucketSpec], forced: str | None = None) -> BucketSpec:
    """The smallest bucket whose ``max_prompt_tokens`` fits ``num_tokens``.

    ``forced`` names a bucket explicitly (the ``sinkserve.pool`` extension); it must exist and fit.
    Prompts beyond the largest bucket are refused with both numbers in the message.
    """
    ordered = sorted(buckets, key=lambda b: b.max_prompt_tokens)
    if not ordered:
        raise APIError(503, "no pools are configured", type="server_error")
    if forced is not None:
        match = [b for b in ordered if b.name == forced]
        if not match:
            names = ", ".join(b.name for b in ordered)
            raise APIError(400, f"unknown pool {forced!r}; pools are: {names}", "sinkserve.pool")
        if num_tokens > match[0].max_prompt_tokens:
            raise APIError(400, f"prompt has {num_tokens} tokens, more than pool {forced!r} accepts "
                                f"({match[0].max_prompt_tokens} tokens)", "prompt")
        return match[0]
    for b in ordered:
        if num_tokens <= b.max_prompt_tokens:
            return b
    largest = ordered[-1]
    raise APIError(400, f"prompt has {num_tokens} tokens, more than the largest pool ({largest.name!r}) accepts: "
                        f"{largest.max_prompt_tokens} tokens", "prompt")


def pick_version(versions: Sequence[VersionSpec], u: float) -> VersionSpec:
    """Weighted choice by a uniform draw ``u`` in [0, 1).

    Versions are laid out on [0, total) in configuration order; weight 0 takes no room, so a
    version at weight 0 never gets traffic (rollback = set the canary's weight to 0).

    >>> vs = (VersionSpec("v1", "m", 3.0), VersionSpec("v2", "m", 1.0))
    >>> [pick_version(vs, u).name for u in (0.0, 0.74, 0.75, 0.99)]
    ['v1', 'v1', 'v2', 'v2']
    """
    live = [v for v in versions if v.weight > 0]
    if not live:
        raise APIError(503, "every model version has weight 0", type="server_error")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    point = u * sum(v.weight for v in live)
    acc = 0.0
    for v in live:
        acc += v.weight
        if point < acc:
            return v
    return live[-1]  # float round-off at the top edge


def version_for_bucket(bucket: BucketSpec, versions: Sequence[VersionSpec], chosen: VersionSpec, u: float) -> VersionSpec:
    """Keep ``chosen`` if ``bucket`` serves it; otherwise redo the weighted draw (same ``u``)
    among the versions the bucket does serve (a canary deployed on one bucket only).

    >>> b = BucketSpec("long", 8192, 300.0, versions=("v1",))
    >>> vs = (VersionSpec("v1", "m", 1.0), VersionSpec("v2", "m", 1.0))
    >>> version_for_bucket(b, vs, vs[1], 0.9).name
    'v1'
    """
    if bucket.versions is None or chosen.name in bucket.versions:
        return chosen
    served = [v for v in versions if v.name in bucket.versions]
    if not any(v.weight > 0 for v in served):
        return served[0]  # every version this bucket serves is at weight 0: still serve rather than refuse
    return pick_version(served, u)


def reweighted(spec: PlanSpec, weights: dict[str, float]) -> PlanSpec:
    """``spec`` with new version weights (the canary's steps and its rollback, applied live).
    Every named version must exist, weights are >= 0 and at least one is above 0; versions not named
    keep their weight.

    >>> spec = PlanSpec((), (VersionSpec("v1", "m", 100.0), VersionSpec("v2", "m", 0.0)))
    >>> [(v.name, v.weight) for v in reweighted(spec, {"v1": 75, "v2": 25}).versions]
    [('v1', 75.0), ('v2', 25.0)]
    """
    known = {v.name for v in spec.versions}
    unknown = sorted(set(weights) - known)
    if unknown:
        raise ValueError(f"weights: unknown versions {unknown}; versions are {sorted(known)}")
    if any(not isinstance(w, (int, float)) or w < 0 for w in weights.values()):
        raise ValueError(f"weights: must be numbers >= 0, got {weights}")
    versions = tuple(replace(v, weight=float(weights.get(v.name, v.weight))) for v in spec.versions)
    if sum(v.weight for v in versions) <= 0:
        raise ValueError("weights: at least one version needs a weight above 0")
    return replace(spec, versions=versions)


def session_draw(session_id: str) -> float:
    """A stable uniform draw for a session, so one conversation stays on one model version."""
    digest = hashlib.sha256(session_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class TokenBucket:
    """Classic token bucket with an injected clock: ``rate`` tokens/s, at most ``burst`` saved.

    >>> tb = TokenBucket(rate=1.0, burst=2, tokens=2.0, updated=0.0)
    >>> [tb.try_acquire(0.0)[0], tb.try_acquire(0.0)[0], tb.try_acquire(0.0)]
    [True, True, (False, 1.0)]
    >>> tb.try_acquire(1.0)
    (True, 0.0)
    """

    rate: float
    burst: int
    tokens: float
    updated: float

    def try_acquire(self, now: float) -> tuple[bool, float]:
        """Take one token if there is one; otherwise return how long until there is."""
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(float(self.burst), self.tokens + elapsed * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True, 0.0
        return False, (1.0 - self.tokens) / self.rate


class RateLimiter:
    """One token bucket per API key (per ingress replica; replicas share no state)."""

    def __init__(self, rate: float | None, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, key: str | None, now: float) -> None:
        """Raise a 429 ``APIError`` (with Retry-After) when ``key`` is over its rate."""
        if self.rate is None:
            return
        key = key or "anonymous"
        tb = self._buckets.get(key)
        if tb is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()  # bounded memory beats exactness for a forgotten key
            tb = self._buckets[key] = TokenBucket(self.rate, self.burst, float(self.burst), now)
        ok, wait = tb.try_acquire(now)
        if not ok:
            raise APIError(429, f"rate limit exceeded: {self.rate:g} requests/s per key", type="rate_limit_exceeded",
                           retry_after=math.ceil(wait))


# ---- request -> engine inputs -------------------------------------------------------------------


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (fast path, and never a second BOS: ``engine/core/tokenization.py``)."""
    return tokenize_text(tokenizer, text, add_special_tokens)


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The model's chat template if it has one; otherwise a plain ``role: content`` transcript."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def structured_output(request: Request) -> StructuredOutput | None:
    """The grammar ``response_format`` asks for (None for ``text`` or no format), or the one a
    ``required`` / named ``tool_choice`` asks for (``app/plan/tools.py``)."""
    rf = request.response_format
    if isinstance(request, ChatCompletionRequest):
        tools = tool_grammar(tool_mode(request), rf is not None and rf.type != "text")
        if tools is not None:
            return tools
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput("json_object")
    assert rf.json_schema is not None  # the schema model requires it
    return StructuredOutput("json_schema", json.dumps(rf.json_schema.schema_))


def sampling_params(request: Request, vocab_size: int | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``request``, validated (a 400 names the field).

    ``max_tokens`` is ``max_completion_tokens``, else ``max_tokens``, else 16 here; for chat without
    either, :meth:`Planner.plan` replaces it with what is left of the pool's context.
    """
    ext = request.sinkserve
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(request, CompletionRequest) and request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "best_of other than n is not supported (choices are not ranked)", "best_of")
    echo_logprobs = isinstance(request, CompletionRequest) and request.echo and request.wants_logprobs()
    params = SamplingParams(
        max_tokens=request.requested_max_tokens() or DEFAULT_COMPLETION_MAX_TOKENS,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(0, request.top_k),
        seed=request.seed,
        stop=tuple(request.stop_list()),
        logprobs=request.wants_logprobs(),
        ignore_eos=bool(ext and ext.ignore_eos),
        prompt_logprobs=echo_logprobs,
        n=request.n,
        top_logprobs=request.num_top_logprobs() if request.wants_logprobs() else 0,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in (request.logit_bias or {}).items())),
        structured_output=structured_output(request),
        kv_budget_blocks=ext.kv_budget_blocks if ext else None,
    )
    try:
        params.validate(vocab_size)
    except InvalidRequestError as e:
        raise APIError.from_engine(e) from None
    return params


def default_max_tokens(request: Request, bucket: BucketSpec, num_prompt_tokens: int) -> int | None:
    """Chat without ``max_tokens``/``max_completion_tokens``: the pool's ``default_max_tokens`` cap or
    what the prompt leaves of the pool's limit, whichever is smaller (None when the request set a
    limit, or for completions, whose default stays OpenAI's 16).

    >>> b = BucketSpec("long", 8192, 300.0, max_seq_len=1 << 20, default_max_tokens=1024)
    >>> default_max_tokens(ChatCompletionRequest(messages=[{"role": "user", "content": ""}]), b, 20)
    1024
    """
    if not isinstance(request, ChatCompletionRequest) or request.requested_max_tokens() is not None:
        return None
    return _default_cap(bucket, num_prompt_tokens)


def _default_cap(bucket: BucketSpec, num_prompt_tokens: int) -> int | None:
    room = max(1, bucket.max_seq_len - num_prompt_tokens) if bucket.max_seq_len is not None else None
    caps = [c for c in (room, bucket.default_max_tokens) if c is not None]
    return min(caps) if caps else None


def largest_default_max_tokens(bucket: BucketSpec) -> int | None:
    """The most a chat without ``max_tokens`` gets on ``bucket`` (its shortest prompt: one token), for
    ``/v1/models``: the configured cap is not what a pool whose limit is below it gives.

    >>> largest_default_max_tokens(BucketSpec("short", 500, 60.0, max_seq_len=512, default_max_tokens=1024))
    511
    """
    return _default_cap(bucket, 1)


def anchor_spans(request: Request, tokenizer: Any, text: str | None, num_tokens: int) -> tuple[tuple[int, int], ...]:
    """Anchors as token ranges ``(start, end)`` of the prompt the planner tokenized: the engine's one
    resolution (``engine.memory.retention.resolve_anchor_spans``), so the pool receives plain token ranges.

    Text anchors are located in the prompt text (the rendered chat for chat requests), widened to the
    tokens that overlap it. Token ranges must lie inside the prompt. Errors name ``sinkserve.anchors.<i>``.
    """
    if not request.sinkserve or not request.sinkserve.anchors:
        return ()
    anchors = [(a.start, a.end) if isinstance(a, TokenRange) else {"text": a} for a in request.sinkserve.anchors]
    special = not isinstance(request, ChatCompletionRequest)
    try:
        return tuple(resolve_anchor_spans(
            anchors, num_tokens, text,
            lambda: tokenizer(text, return_offsets_mapping=True, add_special_tokens=special)["offset_mapping"],
            param=lambda i: f"sinkserve.anchors.{i}"))
    except InvalidRequestError as e:
        raise APIError(400, e.message, e.field.removesuffix(".text")) from None


def passage_anchor_spans(trimmed: Trimmed | None, request: Request, tokenizer: Any, text: str | None) -> tuple[tuple[int, int], ...]:
    """The kept passages as token ranges of the prompt, when the request asks to pin them."""
    if trimmed is None or not trimmed.report.pinned or text is None:
        return ()
    offsets = tokenizer(text, return_offsets_mapping=True,
                        add_special_tokens=not isinstance(request, ChatCompletionRequest))["offset_mapping"]
    return pinned_token_ranges(trimmed, text, offsets)


class Planner:
    """Plans requests for one ingress replica: its tokenizers (one per distinct model) and rate buckets."""

    def __init__(self, spec: PlanSpec) -> None:
        from transformers import AutoTokenizer  # light compared with the model; loaded once

        self.spec = spec
        self.tokenizers: dict[str, Any] = {}
        for v in spec.versions:
            if v.model not in self.tokenizers:
                self.tokenizers[v.model] = AutoTokenizer.from_pretrained(v.model)
        # Token ids a request may name (logit_bias, /detokenize): the tokenizer's full size.
        self.vocab_sizes = {m: len(t) for m, t in self.tokenizers.items()}
        self.limiter = RateLimiter(spec.ingress.rate_limit_rps, spec.ingress.rate_limit_burst)
        self._rng = random.Random()

    def draw(self, request: Request) -> float:
        """The uniform draw behind the version choice: stable per ``sinkserve.session_id``."""
        sid = request.sinkserve.session_id if request.sinkserve else None
        return session_draw(sid) if sid else self._rng.random()

    def _version(self, pinned: str | None, u: float) -> VersionSpec:
        if pinned is not None:
            match = [v for v in self.spec.versions if v.name == pinned]
            if not match:
                raise APIError(404, f"unknown model version {pinned!r}", "model", "model_not_found")
            return match[0]
        return pick_version(self.spec.versions, u)

    def trim(self, request: Request, version: VersionSpec) -> Trimmed | None:
        """The request with its passages scored, trimmed to the budget and placed (None without passages);
        token counts come from ``version``'s tokenizer."""
        return trim_passages(request, self.tokenizers[version.model], self.spec.ingress.max_passages, encode)

    def tokenize(self, request: Request, version: VersionSpec) -> tuple[list[int], str | None]:
        """Token ids of the prompt (and its text, when there is one, for anchors)."""
        tok = self.tokenizers[version.model]
        text: str | None = None
        if isinstance(request, ChatCompletionRequest):
            text = (render_tool_chat(tok, request, tool_mode(request))
                    or render_chat(tok, [m.model_dump() for m in request.messages]))
            ids = encode(tok, text, add_special_tokens=False)
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise APIError(400, "prompt is empty", "prompt")
            text = request.prompt
            ids = encode(tok, text)
        else:
            ids = list(request.prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "prompt" if isinstance(request, CompletionRequest) else "messages")
        return ids, text

    def tokenize_turn(self, request: Request, version: VersionSpec) -> tuple[list[int], str | None]:
        """A later turn of a conversation: the ids (and text) that continue its history -- no BOS,
        and for chat the template's end of the previous answer and the new messages
        (``app/state/conversations.py``)."""
        tok = self.tokenizers[version.model]
        if isinstance(request, ChatCompletionRequest):
            if request.tools or any(m.role == "tool" or m.tool_calls for m in request.messages):
                raise APIError(400, "tools are not supported on a conversation's later turns (send the whole "
                                    "history without sinkserve.conversation_id)", "tools")
            text = chat_continuation(tok, [m.model_dump() for m in request.messages])
        elif isinstance(request.prompt, str):
            text = request.prompt
        else:
            return list(request.prompt), None
        if not text:
            raise APIError(400, "prompt is empty", "prompt" if isinstance(request, CompletionRequest) else "messages")
        return encode(tok, text, add_special_tokens=False), text

    def tokenize_only(self, body: Any, version: VersionSpec) -> TokenizeResponse:
        """``/tokenize``: the ids a prompt (or chat, rendered with the template) has for ``version``."""
        tok = self.tokenizers[version.model]
        if isinstance(body, TokenizeChatRequest):
            messages = [m.model_dump() for m in body.messages]
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt)
            else:
                text = render_chat(tok, messages)
        else:
            text = body.prompt
        ids = encode(tok, text, add_special_tokens=body.add_special_tokens) if text else []
        limits = [b.max_seq_len for b in self.spec.buckets if b.max_seq_len is not None]
        max_len = max(limits) if limits else max(b.max_prompt_tokens for b in self.spec.buckets) + 1
        strs = list(tok.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids, token_strs=strs)

    def detokenize(self, ids: list[int], version: VersionSpec) -> str:
        """``/detokenize``: the text of ``ids`` (special tokens kept, as vLLM does)."""
        vocab = self.vocab_sizes[version.model]
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", "tokens")
        return self.tokenizers[version.model].decode(ids)

    def plan(self, request: Request, api_key: str | None = None, request_id: str | None = None,
             pinned_version: str | None = None, history: Conversation | None = None) -> RoutePlan:
        """Decide where ``request`` goes and what the pool receives; raises ``APIError`` if refused.
        With ``history`` the request is the next turn of that conversation (its ids are prepended,
        its anchors kept, its model version pinned)."""
        request_id = request_id or new_request_id("req")
        self.limiter.check(api_key, time.monotonic())
        params = sampling_params(request)
        if history is not None:
            return self._plan_turn(request, request_id, params, history, pinned_version)
        u = self.draw(request)
        version = self._version(pinned_version, u)
        trimmed = self.trim(request, version)
        ids, text = self.tokenize(trimmed.request if trimmed else request, version)
        forced = request.sinkserve.pool if request.sinkserve else None
        bucket = pick_bucket(len(ids), self.spec.buckets, forced=forced)
        if pinned_version is not None and bucket.versions is not None and pinned_version not in bucket.versions:
            raise APIError(404, f"version {pinned_version!r} is not served by pool {bucket.name!r}", "model",
                           "model_not_found")
        other = version_for_bucket(bucket, self.spec.versions, version, u)
        if other.model != version.model:  # another tokenizer: trim, tokenize (and bucket) again
            trimmed = self.trim(request, other)
            ids, text = self.tokenize(trimmed.request if trimmed else request, other)
            bucket = pick_bucket(len(ids), self.spec.buckets, forced=forced)
        version = other
        tok = self.tokenizers[version.model]
        anchors = anchor_spans(request, tok, text, len(ids)) + passage_anchor_spans(trimmed, request, tok, text)
        max_tokens = default_max_tokens(request, bucket, len(ids))
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        vocab = self.vocab_sizes.get(version.model)
        if params.logit_bias and vocab is not None and params.logit_bias[-1][0] >= vocab:
            raise APIError(400, f"token id {params.logit_bias[-1][0]} is outside the vocabulary [0, {vocab})", "logit_bias")
        name = pool_deployment_name(bucket.name, version.name)
        # No session: the prompt's leading blocks pick the replica whose prefix cache holds them (when the pool asks).
        preq = PoolRequest(request_id, tuple(ids), params, anchors, bucket.timeout_s, bucket.soft_timeout_s,
                           prefix_affinity=prefix_key(ids, bucket.block_size, bucket.prefix_affinity_tokens))
        report = trimmed.report if trimmed else None
        return RoutePlan(RouteInfo(request_id, bucket.name, version.name, name, len(ids), report), preq)

    def _plan_turn(self, request: Request, request_id: str, params: SamplingParams, conv: Conversation,
                   pinned_version: str | None) -> RoutePlan:
        """The next turn of ``conv``: history + the new message's ids, to the pool that fits them."""
        param = "sinkserve.conversation_id"
        if params.n != 1:
            raise APIError(400, "a conversation turn has one choice (n must be 1)", "n")
        kind = "chat" if isinstance(request, ChatCompletionRequest) else "completion"
        if conv.kind is not None and conv.kind != kind:
            raise APIError(400, f"conversation {conv.id!r} is a {conv.kind} conversation; continue it on the same endpoint", param)
        if conv.version is not None and pinned_version is not None and pinned_version != conv.version:
            raise APIError(400, f"conversation {conv.id!r} runs on model version {conv.version!r}, not {pinned_version!r}", "model")
        pinned = conv.version or pinned_version
        version = self._version(pinned, session_draw(conv.id))
        trimmed = self.trim(request, version)
        body = trimmed.request if trimmed else request
        new, text = self.tokenize_turn(body, version) if conv.token_ids else self.tokenize(body, version)
        prev = len(conv.token_ids)
        ids = list(conv.token_ids) + new
        tok = self.tokenizers[version.model]
        fresh = anchor_spans(request, tok, text, len(new)) + passage_anchor_spans(trimmed, request, tok, text)
        anchors = conv.anchors + tuple((s + prev, e + prev) for s, e in fresh)
        bucket = self._turn_bucket(conv, len(ids), request.sinkserve.pool if request.sinkserve else None, version)
        max_tokens = default_max_tokens(request, bucket, len(ids))
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        name = pool_deployment_name(bucket.name, version.name)
        preq = PoolRequest(request_id, tuple(ids), params, anchors, bucket.timeout_s, bucket.soft_timeout_s, affinity=conv.id)
        report = trimmed.report if trimmed else None
        return RoutePlan(RouteInfo(request_id, bucket.name, version.name, name, len(ids), report, conversation=conv.id,
                                   new_tokens=len(new), policy_version=bucket.policy_version), preq)

    def _turn_bucket(self, conv: Conversation, n: int, forced: str | None, version: VersionSpec) -> BucketSpec:
        """The bucket for a conversation of ``n`` tokens: the smallest whose prompt bound fits; past the
        largest, a pool that streams (``EngineLimits.streams``: it evicts, going on with sinks + window +
        anchors, or runs selected memory; up to its sequence limit); otherwise a 400 with the numbers."""
        served = [b for b in self.spec.buckets if b.versions is None or version.name in b.versions]
        try:
            return pick_bucket(n, served, forced=forced)
        except APIError:
            if forced is not None:
                raise
        streaming = [b for b in sorted(served, key=lambda b: b.max_prompt_tokens, reverse=True)
                     if b.streams and (b.max_seq_len is None or n < b.max_seq_len)]
        if streaming:
            return streaming[0]
        largest = max(served, key=lambda b: b.max_prompt_tokens)
        raise APIError(400, f"conversation {conv.id!r} has {n} tokens with this turn, more than pool {largest.name!r} "
                            f"accepts ({largest.max_prompt_tokens} tokens), and no pool streams past its bound (none evicts "
                            "or runs selected memory, sparse.position_mode compact); start a new conversation",
                       "sinkserve.conversation_id")
