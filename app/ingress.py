"""HTTP ingress: auth, pydantic validation, planning (``app/planner.py``), OpenAI-compatible
endpoints, SSE framing, probes and metrics. Stateless apart from per-replica rate buckets; each
request is planned here and its tokens stream back from the chosen pool on the token bus
(``app/streaming.py``). Ray handle callers use :meth:`Ingress.generate`.

(No ``from __future__ import annotations`` here: FastAPI must see real types on the methods that
``serve.ingress`` rewrites, or ``request: Request`` turns into a query parameter.)
"""


import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from app import metrics as m
from app import openapi
from app.auth import resolve_auth
from app.errors import APIError, from_validation_error
from app.events import RouteInfo, TokenDelta
from app.planner import Planner
from app.replica import data_path_handle, node_address, push_forever, replica_tag
from app.responses import Choices, Echo
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    new_request_id,
)
from app.settings import IngressSpec
from app.sse import DONE, sse_event
from app.streaming import stream_plan
from app.token_bus import TokenInbox

logger = logging.getLogger("sinkserve.ingress")

api = FastAPI(title="sinkserve", description="OpenAI-compatible long-context inference")
openapi.install(api, ErrorResponse)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    # RFC 9110: a 401 names the scheme the client should use.
    return e.response({"WWW-Authenticate": "Bearer"} if e.status == 401 else None)


def _route_headers(info: RouteInfo) -> dict[str, str]:
    return {"x-sinkserve-pool": info.pool, "x-sinkserve-version": info.version, "x-sinkserve-request-id": info.request_id}


class _Timing:
    """Times a stream (TTFT / ITL / end-to-end) for the metrics."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.last: float | None = None
        self.ttft: float | None = None
        self.itl: list[float] = []

    def add(self, d: TokenDelta) -> None:
        now = time.perf_counter()
        if d.token_ids:
            n = len(d.token_ids)
            if self.ttft is None:
                self.ttft = now - self.t0
                # Tokens that came with the first one arrived with it: a gap of 0 each.
                self.itl.extend([0.0] * (n - 1))
            elif self.last is not None:
                # A delta may carry several tokens (merged when the consumer fell behind); spread the
                # gap so ITL stays per token: one sample per token after the first.
                self.itl.extend([(now - self.last) / n] * n)
            self.last = now


@serve.ingress(api)
class Ingress:
    async def __init__(self, spec: IngressSpec, pools: dict[str, Any], hub: Any = None) -> None:
        self.spec = spec
        self.auth = resolve_auth(spec.auth)  # raises (replica fails to start) when no keys are set
        self.planner = Planner(spec.plan)
        # deployment name -> handle; the pool's deltas come back on the token bus
        self.pools = {name: data_path_handle(h) for name, h in pools.items()}
        self.hub = hub
        self.replica = replica_tag()
        self.metrics = m.RequestMetrics()
        # Deltas and errors come back on the token bus, one frame per engine step (app/token_bus.py).
        self.inbox = TokenInbox()
        await self.inbox.start(node_address())
        self._push = None
        if hub is not None:
            self._push = asyncio.get_running_loop().create_task(
                push_forever(hub, f"ingress/{self.replica}", self._entry, spec.stats_push_interval_s)
            )

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's ``user_config`` at start and whenever only that
        changes (``serve deploy``, no restart): ``{"weights": {version: weight}}`` moves traffic
        between model versions live -- the canary's steps and its rollback (``sinkserve canary``)."""
        from app.planner import reweighted

        weights = (user_config or {}).get("weights")
        if weights:
            self.planner.spec = reweighted(self.planner.spec, dict(weights))
            logger.info("version weights now %s", {v.name: v.weight for v in self.planner.spec.versions})

    def _entry(self) -> dict[str, Any]:
        return {"kind": "ingress", "replica": self.replica, "data": self.metrics.snapshot()}

    async def __del__(self) -> None:
        if self._push is not None:
            self._push.cancel()
        await self.inbox.stop()

    # ---- probes and metrics (no auth: load balancers and scrapers) ------------------------------

    @api.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    @api.get("/readyz")
    async def readyz(self) -> JSONResponse:
        try:
            snap = await self.hub.snapshot.remote() if self.hub is not None else {}
        except Exception as e:  # hub not up yet: not ready
            return JSONResponse({"ready": False, "error": str(e)}, status_code=503)
        pools = m.ready_pools(snap, self.spec.pool_deployments)
        ok = all(pools.values())
        return JSONResponse({"ready": ok, "pools": pools}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        snap: dict[str, Any] = {}
        if self.hub is not None:
            await self.hub.report.remote(f"ingress/{self.replica}", self._entry())
            snap = await self.hub.snapshot.remote()
        return Response(m.render(snap), media_type=m.CONTENT_TYPE)

    @api.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._authorize(request)
        name = self.spec.served_model_name
        cards = [ModelCard(id=name, kv_cache=dict(self.spec.kv_cache) or None)] + [ModelCard(id=f"{name}@{v.name}", fingerprint=v.fingerprint, weight=v.weight,
                                                                  architecture=v.architecture)
                                        for v in self.planner.spec.versions]
        return ModelList(data=cards)

    # ---- OpenAI endpoints -----------------------------------------------------------------------

    @api.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest)

    @api.post("/tokenize", openapi_extra=openapi.body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}`` -> ids and count."""
        key = self._authorize(request)
        raw = await request.body()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None  # pydantic names the problem below
        chat = isinstance(parsed, dict) and "messages" in parsed
        try:
            body = (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate_json(raw)
        except ValidationError as e:
            raise from_validation_error(e)
        self.planner.limiter.check(key, time.monotonic())
        version = self._tokenizer_version(body.model)
        out: TokenizeResponse = self.planner.tokenize_only(body, version)
        return JSONResponse(out.model_dump(exclude_none=True))

    @api.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        key = self._authorize(request)
        try:
            body = DetokenizeRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise from_validation_error(e)
        self.planner.limiter.check(key, time.monotonic())
        version = self._tokenizer_version(body.model)
        return JSONResponse(DetokenizeResponse(prompt=self.planner.detokenize(body.tokens, version)).model_dump())

    def _tokenizer_version(self, model: str | None) -> Any:
        """The version whose tokenizer answers: the pinned one (``name@version``), else the first
        version with traffic (versions normally share a tokenizer)."""
        return self.planner._version(self._pinned_version(model), 0.0)

    # ---- Python callers (Ray handles) -----------------------------------------------------------

    async def generate(
        self, request: CompletionRequest | ChatCompletionRequest, request_id: str | None = None
    ) -> AsyncIterator[RouteInfo | TokenDelta | APIError]:
        """Stream events for a handle caller (inside the cluster, so no bearer token): ``RouteInfo``,
        then ``TokenDelta``s; or an ``APIError`` (first, or after some deltas). See docs/handle_example.py."""
        try:
            plan = self.planner.plan(request, None, request_id, self._pinned_version(request.model))
        except APIError as e:
            yield e
            return
        async for ev in stream_plan(self.pools[plan.info.deployment], plan, self.inbox):
            yield ev

    # ---- internals ------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> str | None:
        try:
            return self.auth.check(request.headers.get("authorization"))
        except PermissionError as e:
            self.metrics.count("none", 401)
            raise APIError(401, str(e), None, "authentication_error")

    def _pinned_version(self, model: str | None) -> str | None:
        """``model`` may be absent, the served name, or ``name@version`` to pin a version."""
        if model is None or model == self.spec.served_model_name:
            return None
        name, sep, version = model.partition("@")
        if sep and name == self.spec.served_model_name and version in self.spec.versions:
            return version
        raise APIError(404, f"model {model!r} does not exist; see GET /v1/models", "model", "model_not_found")

    async def _serve(self, request: Request, cls: type) -> Response:
        t0 = time.perf_counter()
        key = self._authorize(request)
        try:
            raw = await request.body()
            body = cls.model_validate_json(raw)
        except ValidationError as e:
            self.metrics.count("none", 400)
            raise from_validation_error(e)
        try:
            pinned = self._pinned_version(body.model)
        except APIError as e:
            self.metrics.count("none", e.status)
            raise
        chat = isinstance(body, ChatCompletionRequest)
        request_id = new_request_id("chatcmpl" if chat else "cmpl")
        try:
            plan = self.planner.plan(body, key, request_id, pinned)
        except APIError as e:
            self.metrics.count("none", e.status)
            raise
        if plan.info.passages is not None:
            self.metrics.trimmed(plan.info.pool, plan.info.passages.tokens_saved)
        gen = stream_plan(self.pools[plan.info.deployment], plan, self.inbox)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            self.metrics.count(plan.info.pool, 500)
            raise APIError(500, "empty response from pool", type="server_error")
        if isinstance(first, APIError):
            self.metrics.count(plan.info.pool, first.status)
            raise first
        assert isinstance(first, RouteInfo)
        if body.stream:
            return StreamingResponse(
                self._sse(gen, first, body, chat, t0, plan.request.prompt_token_ids),
                media_type="text/event-stream",
                headers={**_route_headers(first), "Cache-Control": "no-cache"},
            )
        return await self._unary(gen, first, body, chat, t0, plan.request.prompt_token_ids)

    def _record(self, pool: str, status: int, acc: _Timing) -> None:
        self.metrics.count(pool, status)
        if acc.ttft is not None:
            self.metrics.ttft[pool].observe(acc.ttft)
        for gap in acc.itl:
            self.metrics.itl[pool].observe(gap)
        self.metrics.e2e[pool].observe(time.perf_counter() - acc.t0)

    def _choices(self, body: Any, info: RouteInfo, prompt_ids: tuple[int, ...]) -> Choices:
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            tok = self.planner.tokenizers[self._model_of(info.version)]
            text = body.prompt if isinstance(body.prompt, str) else tok.decode(list(prompt_ids))
            toks = tuple(tok.convert_ids_to_tokens(list(prompt_ids))) if body.wants_logprobs() else ()
            echo = Echo(text, toks)
        return Choices(body, info, body.model or self.spec.served_model_name, echo)

    def _model_of(self, version: str) -> str:
        return next(v.model for v in self.spec.plan.versions if v.name == version)

    async def _unary(self, gen: Any, info: RouteInfo, body: Any, chat: bool, t0: float,
                     prompt_ids: tuple[int, ...] = ()) -> Response:
        acc = _Timing(t0)
        choices = self._choices(body, info, prompt_ids)
        try:
            async for ev in gen:
                if isinstance(ev, APIError):
                    self.metrics.count(info.pool, ev.status)
                    raise ev
                acc.add(ev)
                choices.add(ev)
        except asyncio.CancelledError:
            self.metrics.count(info.pool, 499)  # client went away; stream_plan cancels the pool call
            raise
        self._record(info.pool, 200, acc)
        return JSONResponse(json.loads(choices.response().model_dump_json()), headers=_route_headers(info))

    async def _sse(self, gen: Any, info: RouteInfo, body: Any, chat: bool, t0: float,
                   prompt_ids: tuple[int, ...] = ()) -> AsyncIterator[bytes]:
        acc = _Timing(t0)
        choices = self._choices(body, info, prompt_ids)
        status = 200
        finished = False
        try:
            for first in choices.first_chunks():
                yield sse_event(first)
            async for ev in gen:
                if isinstance(ev, APIError):
                    # Headers are gone already; the error travels as a final SSE event.
                    status = ev.status
                    yield sse_event(ev.body())
                    break
                acc.add(ev)
                choices.add(ev)
                chunk = choices.chunk(ev)
                if chunk is not None:
                    yield sse_event(chunk)
                if ev.finished:
                    finished = True
                    if body.include_usage():
                        yield sse_event(choices.usage_chunk())
                    break
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # client disconnected mid-stream
            raise
        finally:
            if not finished:
                await gen.aclose()  # cancels the pool call: abort in the engine now
            self._record(info.pool, status, acc)
