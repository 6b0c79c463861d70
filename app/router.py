"""Router deployment: tokenize once, pick a model version (weights) and a length bucket, enforce
per-key rates, per-bucket timeouts and pool queue caps, then stream the pool's output back.

The decisions themselves are pure functions in :mod:`app.routing`; this module is the glue.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from app.coalesce import coalesced
from app.events import ErrorEvent, PoolRequest, RouteInfo, TokenDelta
from app.routing import RateLimiter, RoutingError, pick_bucket, pick_version, session_draw, version_for_bucket
from app.schemas import ChatCompletionRequest, CompletionRequest, TokenRange, new_request_id
from app.settings import RouterSpec, VersionSpec, pool_deployment_name

logger = logging.getLogger("sinkserve.router")


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
        at = text.find(a)
        if at < 0:
            raise RoutingError(400, f"sinkserve.anchors.{i}", "anchor text does not occur in the prompt")
        if offsets is None:
            offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=not isinstance(
                request, ChatCompletionRequest))["offset_mapping"]
        end = at + len(a)
        toks = [t for t, (s, e) in enumerate(offsets) if e > s and s < end and e > at]
        out.append((toks[0], toks[-1] + 1))
    return tuple(out)


class Router:
    """Stateless apart from per-replica rate buckets and loaded tokenizers."""

    def __init__(self, spec: RouterSpec, pools: dict[str, Any]) -> None:
        from transformers import AutoTokenizer  # light compared with the model; loaded once

        self.spec = spec
        self.pools = pools  # deployment name -> DeploymentHandle
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
            ids = tok(text, add_special_tokens=False)["input_ids"]
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise RoutingError(400, "prompt", "prompt is empty")
            text = request.prompt
            ids = tok(text)["input_ids"]
        else:
            ids = list(request.prompt)
        if not ids:
            raise RoutingError(400, "prompt" if isinstance(request, CompletionRequest) else "messages", "prompt is empty")
        return ids, text

    async def route(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        api_key: str | None = None,
        request_id: str | None = None,
        pinned_version: str | None = None,
    ) -> AsyncIterator[RouteInfo | TokenDelta | ErrorEvent]:
        """Stream ``RouteInfo``, then ``TokenDelta``s; or one ``ErrorEvent``."""
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
            yield ErrorEvent(e.status, e.message, field=e.field, retry_after=e.retry_after,
                             type="rate_limit_exceeded" if e.status == 429 else "invalid_request_error")
            return
        name = pool_deployment_name(bucket.name, version.name)
        tok = self.tokenizers[version.model]
        want_tokens = request.wants_logprobs()
        preq = PoolRequest(request_id, tuple(ids), sampling_from(request), anchors, bucket.timeout_s)
        stream = self.pools[name].options(stream=True).generate.remote(preq)
        source = coalesced(stream)
        deadline = time.monotonic() + bucket.timeout_s
        started = done = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    ev = await asyncio.wait_for(source.__anext__(), timeout=max(remaining, 0.001))
                except StopAsyncIteration:
                    done = True
                    return
                if not started:
                    started = True
                    if not isinstance(ev, ErrorEvent):
                        yield RouteInfo(request_id, bucket.name, version.name, name, len(ids))
                if isinstance(ev, TokenDelta) and want_tokens and ev.token_ids:
                    ev = replace(ev, tokens=tuple(tok.convert_ids_to_tokens(list(ev.token_ids))))
                yield ev
                if isinstance(ev, ErrorEvent) or (isinstance(ev, TokenDelta) and ev.finished):
                    done = True
                    return
        except asyncio.TimeoutError:
            logger.info("request %s timed out after %.1fs in pool %s", request_id, bucket.timeout_s, name)
            yield ErrorEvent(408, f"request timed out after {bucket.timeout_s:g}s in pool {bucket.name!r}",
                             type="timeout")
        except Exception as e:
            from ray.serve.exceptions import BackPressureError

            if isinstance(e, BackPressureError):
                yield ErrorEvent(503, f"pool {bucket.name!r} is at capacity; retry later", retry_after=1,
                                 type="overloaded")
                return
            logger.exception("request %s failed in pool %s", request_id, name)
            yield ErrorEvent(500, f"internal error in pool {bucket.name!r}: {type(e).__name__}", type="server_error")
        finally:
            if not done:
                # Timeout, client gone or error: cancel the pool call, which aborts the request in
                # the engine and frees its blocks at once.
                stream.cancel()
