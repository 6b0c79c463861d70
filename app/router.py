"""Router deployment: tokenize once, pick a model version (weights) and a length bucket, enforce
per-key rates, per-bucket timeouts and pool queue caps, then stream the pool's output back.

The decisions themselves are pure functions in :mod:`app.routing`; this module is the glue.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, AsyncIterator

from app.events import ErrorEvent, PoolRequest, RouteInfo, RoutePlan, TokenDelta
from app.replica import data_path_handle
from app.routing import RateLimiter, RoutingError, pick_bucket, pick_version, session_draw, version_for_bucket
from app.schemas import ChatCompletionRequest, CompletionRequest, TokenRange, new_request_id
from app.streaming import stream_plan
from app.settings import RouterSpec, VersionSpec, pool_deployment_name
from engine.retention import text_anchor_span

logger = logging.getLogger("sinkserve.router")


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. For a fast tokenizer, its Rust backend directly: the same ids as
    ``tokenizer(text)["input_ids"]`` (tested) for a third of the CPU, since the call wraps one prompt
    in batching, truncation and padding logic; this runs on the ingress's event loop per request."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The model's chat template if it has one; otherwise a plain ``role: content`` transcript."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def sampling_from(request: CompletionRequest | ChatCompletionRequest) -> tuple[tuple[str, object], ...]:
    ext = request.sinkserve
    return (
        ("max_tokens", request.max_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("top_k", max(0, request.top_k)),
        ("seed", request.seed),
        ("stop", tuple(request.stop_list())),
        ("logprobs", request.wants_logprobs()),
        ("ignore_eos", bool(ext and ext.ignore_eos)),
    )


def anchors_from(
    request: CompletionRequest | ChatCompletionRequest, tokenizer: Any, text: str | None
) -> tuple[tuple[int, int], ...]:
    """Anchors as token ranges ``(start, end)`` of the prompt the router tokenized.

    The router tokenizes once and hands the pool token ids, so text anchors are located here: the
    first occurrence of the span in the prompt text (the rendered chat for chat requests), widened
    to the tokens that overlap it.
    """
    if not request.sinkserve or not request.sinkserve.anchors:
        return ()
    out: list[tuple[int, int]] = []
    offsets = None
    for i, a in enumerate(request.sinkserve.anchors):
        if isinstance(a, TokenRange):
            out.append((a.start, a.end))
            continue
        if text is None:
            raise RoutingError(400, f"sinkserve.anchors.{i}", "text anchors need a text prompt (not token ids)")
        if offsets is None:
            offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=not isinstance(
                request, ChatCompletionRequest))["offset_mapping"]
        span = text_anchor_span(text, a, offsets)
        if span is None:
            raise RoutingError(400, f"sinkserve.anchors.{i}", "anchor text does not occur in the prompt")
        out.append(span)
    return tuple(out)


class Router:
    """Stateless apart from per-replica rate buckets and loaded tokenizers."""

    def __init__(self, spec: RouterSpec, pools: dict[str, Any]) -> None:
        from transformers import AutoTokenizer  # light compared with the model; loaded once

        self.spec = spec
        self.pools = {name: data_path_handle(h, spec.grpc_handles) for name, h in pools.items()}
        self.tokenizers = {}
        for v in spec.versions:
            if v.model not in self.tokenizers:
                self.tokenizers[v.model] = AutoTokenizer.from_pretrained(v.model)
        self.limiter = RateLimiter(spec.rate_limit_rps, spec.rate_limit_burst)
        self._rng = random.Random()

    def _draw(self, request: CompletionRequest | ChatCompletionRequest) -> float:
        sid = request.sinkserve.session_id if request.sinkserve else None
        return session_draw(sid) if sid else self._rng.random()

    def _version(self, pinned: str | None, u: float) -> VersionSpec:
        if pinned is not None:
            match = [v for v in self.spec.versions if v.name == pinned]
            if not match:
                raise RoutingError(404, "model", f"unknown model version {pinned!r}")
            return match[0]
        return pick_version(self.spec.versions, u)

    def _tokenize(
        self, request: CompletionRequest | ChatCompletionRequest, version: VersionSpec
    ) -> tuple[list[int], str | None]:
        """Token ids of the prompt (and its text, when there is one, for anchors)."""
        tok = self.tokenizers[version.model]
        text: str | None = None
        if isinstance(request, ChatCompletionRequest):
            text = render_chat(tok, [m.model_dump() for m in request.messages])
            ids = encode(tok, text, add_special_tokens=False)
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise RoutingError(400, "prompt", "prompt is empty")
            text = request.prompt
            ids = encode(tok, text)
        else:
            ids = list(request.prompt)
        if not ids:
            raise RoutingError(400, "prompt" if isinstance(request, CompletionRequest) else "messages", "prompt is empty")
        return ids, text

    async def plan(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        api_key: str | None = None,
        request_id: str | None = None,
        pinned_version: str | None = None,
    ) -> RoutePlan | ErrorEvent:
        """Decide (rate, version, tokenize once, bucket, anchors) without streaming anything."""
        request_id = request_id or new_request_id("req")
        try:
            self.limiter.check(api_key, time.monotonic())
            u = self._draw(request)
            version = self._version(pinned_version, u)
            ids, text = self._tokenize(request, version)
            forced = request.sinkserve.pool if request.sinkserve else None
            bucket = pick_bucket(len(ids), self.spec.buckets, forced=forced)
            if pinned_version is not None and bucket.versions is not None and pinned_version not in bucket.versions:
                raise RoutingError(404, "model", f"version {pinned_version!r} is not served by pool {bucket.name!r}")
            other = version_for_bucket(bucket, self.spec.versions, version, u)
            if other.model != version.model:
                ids, text = self._tokenize(request, other)
                bucket = pick_bucket(len(ids), self.spec.buckets, forced=forced)
            version = other
            anchors = anchors_from(request, self.tokenizers[version.model], text)
        except RoutingError as e:
            return ErrorEvent(e.status, e.message, field=e.field, retry_after=e.retry_after,
                              type="rate_limit_exceeded" if e.status == 429 else "invalid_request_error")
        name = pool_deployment_name(bucket.name, version.name)
        preq = PoolRequest(request_id, tuple(ids), sampling_from(request), anchors, bucket.timeout_s)
        return RoutePlan(RouteInfo(request_id, bucket.name, version.name, name, len(ids)), preq)

    async def route(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        api_key: str | None = None,
        request_id: str | None = None,
        pinned_version: str | None = None,
    ) -> AsyncIterator[RouteInfo | TokenDelta | ErrorEvent]:
        """For handle callers entering at the router: ``plan`` then stream from the pool.
        Yields ``RouteInfo``, then ``TokenDelta``s; or one ``ErrorEvent``."""
        plan = await self.plan(request, api_key, request_id, pinned_version)
        if isinstance(plan, ErrorEvent):
            yield plan
            return
        async for ev in stream_plan(self.pools[plan.info.deployment], plan):
            yield ev
