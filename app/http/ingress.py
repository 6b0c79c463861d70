"""HTTP ingress: auth, pydantic validation, planning (``app/plan/planner.py``), OpenAI-compatible
endpoints, SSE framing, probes and metrics. Stateless apart from per-replica rate buckets; each
request is planned here and its tokens stream back from the chosen pool on the token bus
(``app/pool/streaming.py``). Ray handle callers use :meth:`Ingress.generate`.

(No ``from __future__ import annotations`` here: FastAPI must see real types on the methods that
``serve.ingress`` rewrites, or ``request: Request`` turns into a query parameter.)
"""


import asyncio
import json
from dataclasses import replace
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from app import log_masking
from app import metrics as m
from app.http import openapi
from app.http.audit import AuditLog, AuditRecord
from app.http.auth import resolve_auth
from app.state.conversations import HEADER as CONVERSATION_HEADER
from app.state.conversations import ID_PATTERN, Conversation, ConversationStore, Turn
from app.errors import APIError, from_validation_error
from app.events import RouteInfo, RoutePlan, TokenDelta
from app.state.jobs import JobQueue
from app.state.quotas import Quotas, Reservation
from app.state import StoreError, open_store
from app.state.base import call as store_call
from app.state.base import purge_forever
from app.plan.plan_pool import PlanPool
from app.plan.planner import Planner, largest_default_max_tokens
from app.http.request_body import read_body
from app.pool.replica import data_path_handle, node_address, push_forever, replica_tag
from app.pool.router_view import routed_replicas
from app.http.responses import Choices, Echo
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    SinkserveExtension,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    new_request_id,
)
from app.settings import IngressSpec
from app.http.sse import DONE, SettledStreamingResponse, sse_event
from app.pool.failover import fallback_plans, stream_with_failover
from engine.frontend.token_bus import TokenInbox
from engine.core.detokenizer import token_text

logger = logging.getLogger("sinkserve.ingress")

api = FastAPI(title="sinkserve", description="OpenAI-compatible long-context inference")
openapi.install(api, ErrorResponse)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    # RFC 9110: a 401 names the scheme the client should use.
    return e.response({"WWW-Authenticate": "Bearer"} if e.status == 401 else None)


def _route_headers(info: RouteInfo) -> dict[str, str]:
    h = {"x-sinkserve-pool": info.pool, "x-sinkserve-version": info.version, "x-sinkserve-request-id": info.request_id}
    if info.conversation is not None:
        h[CONVERSATION_HEADER] = info.conversation
    return h


def _parse_job(raw: bytes) -> "CompletionRequest | ChatCompletionRequest":
    """A ``/v1/jobs`` body -> the request it wraps; a 400 naming the field otherwise."""
    try:
        job = json.loads(raw)
    except ValueError:
        raise APIError(400, "body must be a JSON object", "body") from None
    endpoint = job.get("endpoint") if isinstance(job, dict) else None
    cls = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}.get(endpoint)
    if cls is None:
        raise APIError(400, "endpoint must be '/v1/completions' or '/v1/chat/completions'", "endpoint")
    try:
        return cls.model_validate(job.get("body"))
    except ValidationError as e:
        err = from_validation_error(e)
        raise APIError(400, err.message, f"body.{err.param}") from None


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, gateways see bytes


class _Turn:
    """One request's accounting: who asked, what it cost, and (for a conversation turn) what to
    commit. Settled exactly once, however the request ends."""

    def __init__(self, tenant: str, plan: RoutePlan, conv: Conversation | None, body: Any,
                 lock: str | None = None, reservation: Reservation | None = None) -> None:
        self.tenant = tenant
        self.plan = plan
        self.conv = conv
        self.lock = lock  # the conversation's turn-lock owner token
        self.reservation = reservation  # the prompt tokens reserved against the tenant's quota
        self.body = body
        self.completion_ids: dict[int, list[int]] = {}
        self.completion_tokens: dict[int, int] = {}
        self.texts: dict[int, list[str]] = {}
        self.prompt_tokens = plan.info.prompt_tokens
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.finished = False
        self.settled = False
        self.body_started = False  # a streamed response's body began (its finally settles the turn)

    def add(self, d: TokenDelta) -> None:
        self.completion_ids.setdefault(d.index, []).extend(d.token_ids)
        self.texts.setdefault(d.index, []).append(d.text)
        self.completion_tokens[d.index] = d.completion_tokens
        self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        self.finished = self.finished or d.finished

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + sum(self.completion_tokens.values())


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
        log_masking.install()  # no credential (a store URL's password) in any log line of this replica
        self.spec = spec
        self.auth = resolve_auth(spec.auth)  # raises (replica fails to start) when no keys are set
        self.planner = Planner(spec.plan)
        self.plan_pool = PlanPool(spec.ingress.plan_threads, spec.ingress.plan_max_waiting)  # planning off the event loop
        # deployment name -> handle; the pool's deltas come back on the token bus
        self.pools = {name: data_path_handle(h) for name, h in pools.items()}
        self.hub = hub
        self.replica = replica_tag()
        self.metrics = m.RequestMetrics(known_tenants=[t for t, _ in spec.tenants])
        # Sessions, quotas (and jobs) live in the store; it connects on first use, and a store that
        # fails shows in /readyz while requests without a conversation keep working.
        self.store = open_store(spec.store)
        self.conversations = ConversationStore(self.store, spec.sessions.ttl_s)
        self.quotas = Quotas(self.store, dict(spec.tenants), fail_closed=spec.quotas.fail_closed)
        self.jobs = JobQueue(self.store)
        self.audit = AuditLog(spec.audit.path, spec.audit.include_text) if spec.audit.path else None
        # Deltas and errors come back on the token bus, one frame per engine message, written by the
        # engine's process itself (engine/frontend/token_bus.py); its errors become APIErrors here.
        self.inbox = TokenInbox(error=APIError.from_stream_error)
        await self.inbox.start(node_address())
        self._push = None
        self._tasks: set[asyncio.Task[Any]] = set()  # fire-and-forget work (settling, releasing), kept referenced
        self._purge = asyncio.get_running_loop().create_task(purge_forever(self.store))
        self._watch = None
        # Deployments with a ready replica, as the hub last said (None: not known yet); app/pool/failover.py.
        self._ready_deployments: set[str] | None = None
        if hub is not None:
            self._push = asyncio.get_running_loop().create_task(
                push_forever(hub, f"ingress/{self.replica}", self._entry, spec.stats_push_interval_s)
            )
            self._watch = asyncio.get_running_loop().create_task(self._watch_pools())

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's ``user_config`` at start and whenever only that
        changes (``serve deploy``, no restart): ``{"weights": {version: weight}}`` moves traffic
        between model versions live -- the canary's steps and its rollback (``sinkserve canary``)."""
        from app.plan.planner import reweighted

        weights = (user_config or {}).get("weights")
        if weights:
            self.planner.spec = reweighted(self.planner.spec, dict(weights))
            logger.info("version weights now %s", {v.name: v.weight for v in self.planner.spec.versions})

    def _entry(self) -> dict[str, Any]:
        return {"kind": "ingress", "replica": self.replica, "data": self.metrics.snapshot()}

    async def __del__(self) -> None:
        if self._push is not None:
            self._push.cancel()
        self._purge.cancel()
        if self._watch is not None:
            self._watch.cancel()
        await self.inbox.stop()
        self.plan_pool.shutdown()
        self.store.close()
        if self.audit is not None:
            self.audit.close()

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
        store: dict[str, Any] = {"kind": self.store.kind, "ok": True}
        try:
            await asyncio.wait_for(store_call(self.store.ping), 5.0)
        except StoreError as e:
            # Unauthenticated: the reason without the URL (the log has it, password masked).
            logger.warning("readiness: %s", e)
            store = {"kind": self.store.kind, "ok": False, "error": e.public}
        except asyncio.TimeoutError:
            store = {"kind": self.store.kind, "ok": False, "error": "no answer within 5 s"}
        ok = all(pools.values()) and store["ok"]
        return JSONResponse({"ready": ok, "pools": pools, "store": store}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """The operational series (no key); per-tenant series are on ``/metrics/tenants``."""
        return Response(m.render(await self._snapshot()), media_type=m.CONTENT_TYPE)

    @api.get("/metrics/tenants")
    async def tenant_metrics(self, request: Request) -> Response:
        """Per-tenant token and request counters: an operator key only (app/http/auth.py)."""
        self._require_operator(self._authorize(request), "/metrics/tenants")
        return Response(m.render(await self._snapshot(), "tenants"), media_type=m.CONTENT_TYPE)

    async def _snapshot(self) -> dict[str, Any]:
        if self.hub is None:
            return {"local": self._entry()}
        await self.hub.report.remote(f"ingress/{self.replica}", self._entry())
        return await self.hub.snapshot.remote()

    @api.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._authorize(request)
        name = self.spec.served_model_name
        limits = {pool: lim.as_dict() for pool, lim in self.spec.limits} or None
        caps = {b.name: cap for b in self.planner.spec.buckets if (cap := largest_default_max_tokens(b)) is not None}
        cards = [ModelCard(id=name, kv_cache=dict(self.spec.kv_cache) or None, limits=limits, default_max_tokens=caps or None)] + [ModelCard(id=f"{name}@{v.name}", fingerprint=v.fingerprint, weight=v.weight,
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
        raw = await read_body(request, self.spec.ingress.max_body_bytes)

        def parse() -> Any:
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None  # pydantic names the problem below
            chat = isinstance(parsed, dict) and "messages" in parsed
            try:
                return (TokenizeChatRequest if chat else TokenizeCompletionRequest).model_validate_json(raw)
            except ValidationError as e:
                raise from_validation_error(e)

        body = await self.plan_pool.run(parse)
        self.planner.limiter.check(key, time.monotonic())
        version = self._tokenizer_version(body.model)
        out: TokenizeResponse = await self.plan_pool.run(self.planner.tokenize_only, body, version)
        return JSONResponse(out.model_dump(exclude_none=True))

    @api.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        key = self._authorize(request)
        raw = await read_body(request, self.spec.ingress.max_body_bytes)
        try:
            body = await self.plan_pool.run(DetokenizeRequest.model_validate_json, raw)
        except ValidationError as e:
            raise from_validation_error(e)
        self.planner.limiter.check(key, time.monotonic())
        version = self._tokenizer_version(body.model)
        text = await self.plan_pool.run(self.planner.detokenize, body.tokens, version)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

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
            plan = await self.plan_pool.run(self.planner.plan, request, None, request_id,
                                            self._pinned_version(request.model))
        except APIError as e:
            yield e
            return
        async for ev in self._stream(plan, request):
            yield ev

    # ---- internals ------------------------------------------------------------------------------

    def _stream(self, plan: RoutePlan, body: Any) -> AsyncIterator[RouteInfo | TokenDelta | APIError]:
        """The plan's events from its pool, or from another pool that fits it while its own has no live
        engine (app/pool/failover.py); a request that named its pool stays there."""
        forced = body.sinkserve is not None and body.sinkserve.pool is not None
        fallbacks = [] if forced else fallback_plans(plan, self.spec.plan.buckets, list(self.pools))
        return stream_with_failover(plan, fallbacks, self.pools, self.inbox, self._deployment_ready,
                                    self.metrics.failover, self.spec.ingress.replica_wait_s)

    def _deployment_ready(self, deployment: str) -> bool:
        """Whether ``deployment`` has a live replica: the hub lists a ready one, or (its entry can lapse
        while a loaded replica pushes late) this process's Serve router still lists running replicas. Only
        when both say none is a call that no replica took refused or moved (app/pool/failover.py)."""
        if self._ready_deployments is None or deployment in self._ready_deployments:
            return True
        return bool(routed_replicas(deployment))

    async def _watch_pools(self, interval_s: float = 0.5) -> None:
        """Keep ``_ready_deployments`` current from the hub (pools push their readiness)."""
        while True:
            try:
                snap = await self.hub.snapshot.remote()
                self._ready_deployments = {d for d, ok in m.ready_pools(snap, self.pools).items() if ok}
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - unknown readiness: route as planned
                self._ready_deployments = None
                logger.debug("pool readiness unknown: %s", e)
            await asyncio.sleep(interval_s)

    def _authorize(self, request: Request) -> str | None:
        try:
            return self.auth.check(request.headers.get("authorization"))
        except PermissionError as e:
            self.metrics.count("none", 401)
            raise APIError(401, str(e), None, "authentication_error")

    def _require_operator(self, key: str | None, what: str) -> None:
        if not self.auth.is_operator(key):
            raise APIError(403, f"{what} needs an operator key (SINKSERVE_OPERATOR_KEYS; docs/operations.md)", what,
                           "permission_error")

    def _check_operator_options(self, key: str | None, body: Any, pinned: str | None) -> None:
        """Options that take capacity or versions away from the traffic split are for operators:
        forcing a pool (the scarce long pool), pinning a version with no traffic (weight 0)."""
        if body.sinkserve is not None and body.sinkserve.pool is not None:
            self._require_operator(key, "sinkserve.pool")
        if pinned is not None and any(v.name == pinned and v.weight <= 0 for v in self.planner.spec.versions):
            self._require_operator(key, "model")

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
        tenant = self.auth.tenant_of(key)
        try:
            raw = await read_body(request, self.spec.ingress.max_body_bytes)
            body = await self.plan_pool.run(cls.model_validate_json, raw)
        except ValidationError as e:
            self.metrics.count("none", 400)
            raise from_validation_error(e)
        except APIError as e:  # too large, or the planning threads are saturated
            self.metrics.count("none", e.status)
            raise
        conv: Conversation | None = None
        lock: str | None = None
        try:
            pinned = self._pinned_version(body.model)
            self._check_operator_options(key, body, pinned)
            conv_id = self._conversation_id(request, body)
            if conv_id is not None:
                conv, lock = await self._claim_conversation(conv_id, tenant)
        except APIError as e:
            self.metrics.count("none", e.status)
            raise
        chat = isinstance(body, ChatCompletionRequest)
        request_id = new_request_id("chatcmpl" if chat else "cmpl")
        reservation = None
        try:
            plan = await self.plan_pool.run(self.planner.plan, body, key, request_id, pinned, history=conv)
            if self.quotas.limited(tenant):
                reservation = await store_call(self.quotas.reserve, tenant, plan.info.prompt_tokens)
        except BaseException as e:  # any exit before the turn exists releases the lock
            if isinstance(e, APIError):
                self.metrics.count("none", e.status)
            if conv is not None:
                await self._release_now(conv.id, lock)
            if isinstance(e, Exception) and not isinstance(e, APIError):
                logger.exception("request %s: planning failed", request_id)
                self.metrics.count("none", 500)
                raise APIError(500, f"internal error: {type(e).__name__}", type="server_error") from None
            raise
        if plan.info.passages is not None:
            self.metrics.trimmed(plan.info.pool, plan.info.passages.tokens_saved)
        turn = _Turn(tenant, plan, conv, body, lock, reservation)
        try:
            return await self._start(turn, body, chat, t0)
        except asyncio.CancelledError:
            raise
        except APIError:
            raise  # settled by whoever raised it
        except Exception as e:  # a bug on this path: settled (the lock released, the quota reconciled), then a 500
            logger.exception("request %s failed in the ingress", request_id)
            await self._settle(turn, 500, _Timing(t0))
            raise APIError(500, f"internal error: {type(e).__name__}", type="server_error") from None

    async def _start(self, turn: _Turn, body: Any, chat: bool, t0: float) -> Response:
        """Send the planned request to its pool; the response (unary, or an SSE stream)."""
        plan = turn.plan
        gen = self._stream(plan, body)
        first_task = asyncio.ensure_future(gen.__anext__())
        try:
            if body.stream:
                # A slow start (long prefill, queueing) must not leave a gateway without bytes: after
                # keepalive_s the headers go out and keep-alive comments follow until the first token.
                done, _ = await asyncio.wait({first_task}, timeout=self.spec.ingress.keepalive_s)
                if not done:
                    return self._stream_response(gen, plan.info, body, chat, t0, turn, first_task)
            first = await first_task
        except StopAsyncIteration:
            await self._settle(turn, 500, _Timing(t0))
            raise APIError(500, "empty response from pool", type="server_error")
        except asyncio.CancelledError:
            first_task.cancel()
            self._spawn(self._settle(turn, 499, _Timing(t0)))
            raise
        if isinstance(first, APIError):
            await self._settle(turn, first.status, _Timing(t0))
            raise first
        assert isinstance(first, RouteInfo)
        turn.plan = replace(turn.plan, info=first)  # the pool that serves it (another one after a failover)
        if body.stream:
            return self._stream_response(gen, first, body, chat, t0, turn)
        return await self._unary(gen, first, body, chat, t0, turn, plan.request.prompt_token_ids)

    def _stream_response(self, gen: Any, info: RouteInfo, body: Any, chat: bool, t0: float, turn: _Turn,
                         pending: "asyncio.Future[Any] | None" = None) -> Response:
        """The SSE response of ``turn``. Should the client leave before its body starts, the body never
        runs (nor its ``finally``): the pool call is then cancelled and the turn settled here."""

        async def cleanup() -> None:
            if pending is not None and not pending.done():
                pending.cancel()
                try:
                    await pending
                except BaseException:  # noqa: BLE001 - the cancelled first read
                    pass
            try:
                await gen.aclose()  # cancels the pool call: abort in the engine now
            finally:
                await self._settle(turn, 499, _Timing(t0))

        async def on_exit() -> None:
            if turn.body_started or turn.settled:
                return  # the body's own finally settles it
            logger.info("request %s: the client left before the stream started", info.request_id)
            await asyncio.shield(self._spawn(cleanup()))  # runs on even if this task is cancelled again

        return SettledStreamingResponse(
            self._sse(gen, info, body, chat, t0, turn, turn.plan.request.prompt_token_ids, pending), on_exit,
            media_type="text/event-stream", headers={**_route_headers(info), "Cache-Control": "no-cache"})

    # ---- conversations, quotas, audit -----------------------------------------------------------

    def _conversation_id(self, request: Request, body: Any) -> str | None:
        """The conversation a request continues: ``sinkserve.conversation_id`` or the header."""
        header = request.headers.get(CONVERSATION_HEADER)
        field = body.sinkserve.conversation_id if body.sinkserve else None
        if header is not None and not ID_PATTERN.match(header):
            raise APIError(400, f"{CONVERSATION_HEADER} must match {ID_PATTERN.pattern}", CONVERSATION_HEADER)
        if header is not None and field is not None and header != field:
            raise APIError(400, f"{CONVERSATION_HEADER} ({header!r}) and sinkserve.conversation_id ({field!r}) differ",
                           "sinkserve.conversation_id")
        return field or header

    async def _store(self, fn: Any, *args: Any) -> Any:
        """A store call for a conversation: a failing store is a 503 naming the reason."""
        try:
            return await store_call(fn, *args)
        except StoreError as e:
            raise APIError(503, f"conversation store unavailable: {e}", type="server_error", retry_after=5) from None

    async def _claim_conversation(self, conv_id: str, tenant: str) -> tuple[Conversation, str]:
        """The conversation, locked for this turn, and the lock's owner token: 404 naming it when
        unknown, 409 when a turn is running."""
        lock_s = max(b.timeout_s for b in self.spec.plan.buckets) + 30.0
        token = self.conversations.new_lock_token()
        try:
            lock = await store_call(self.conversations.lock, conv_id, lock_s, token)
        except StoreError as e:
            # The store may have taken the claim and died before answering: release it in the
            # background (a no-op when it never landed) so the conversation is not held until expiry.
            self._spawn(self._release_later(conv_id, token))
            raise APIError(503, f"conversation store unavailable: {e}", type="server_error", retry_after=5) from None
        if lock is None:
            raise APIError(409, f"conversation {conv_id!r} has a turn in progress; send the next turn when it ends",
                           "sinkserve.conversation_id", "conflict")
        try:
            conv = await self._store(self.conversations.load, conv_id, tenant)
        except BaseException:
            await self._release_now(conv_id, lock)
            raise
        if conv is None:
            await self._release_now(conv_id, lock)
            raise APIError(404, f"conversation {conv_id!r} does not exist (or has expired); create one with "
                                "POST /v1/conversations", "sinkserve.conversation_id", "not_found")
        return conv, lock

    async def _release(self, conv_id: str, lock: str | None) -> None:
        """Release a turn lock. While the store is down this keeps trying in the background (the
        lock would otherwise hold the conversation until it expires, ``timeout_s`` + 30 s)."""
        if lock is None:
            return
        try:
            if not await store_call(self.conversations.unlock, conv_id, lock):
                logger.warning("conversation %s: the turn's lock had expired before the turn ended", conv_id)
        except StoreError as e:
            logger.warning("conversation %s: turn lock not released yet (retrying): %s", conv_id, e)
            self._spawn(self._release_later(conv_id, lock))

    async def _release_later(self, conv_id: str, lock: str) -> None:
        deadline = time.monotonic() + max(b.timeout_s for b in self.spec.plan.buckets) + 30.0
        delay = 0.25
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)  # the store is usually back within seconds
            try:
                await store_call(self.conversations.unlock, conv_id, lock)
                return
            except StoreError:
                continue

    async def _release_now(self, conv_id: str, lock: str | None) -> None:
        """Release the lock even when this request is being cancelled (the release runs on)."""
        await asyncio.shield(self._spawn(self._release(conv_id, lock)))

    def _spawn(self, coro: Any) -> "asyncio.Task[Any]":
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _settle(self, turn: _Turn, status: int, acc: _Timing) -> APIError | None:
        """Once per request, however it ended: the conversation's new turn (only when it finished),
        the turn lock released, the tenant's quota reconciled, metrics, the audit record. Returns the
        error the client must get instead of success (the turn could not be saved), else None."""
        if turn.settled:
            return None
        turn.settled = True
        info = turn.plan.info
        completion = sum(turn.completion_tokens.values())
        error: APIError | None = None
        try:
            if turn.conv is not None and status == 200 and turn.finished:
                c = turn.conv
                new = c.with_turn(turn.plan.request.prompt_token_ids, tuple(turn.completion_ids.get(0, ())),
                                  turn.plan.request.anchors, info.version, "chat" if isinstance(turn.body, ChatCompletionRequest) else "completion",
                                  Turn(info.request_id, info.new_tokens or 0, turn.prompt_tokens, completion,
                                       turn.cached_tokens, info.pool, info.policy_version or "", turn.finish_reason))
                try:
                    await store_call(self.conversations.save, new)  # one write: the whole turn or none of it
                except StoreError as e:
                    status = 503
                    logger.warning("conversation %s: turn %s not saved: %s", c.id, info.request_id, e)
                    error = APIError(503, f"conversation {c.id!r}: this turn could not be saved ({e.public}); the "
                                          "conversation is as it was before it, send the turn again",
                                     "sinkserve.conversation_id", "server_error", retry_after=1)
        finally:
            if turn.conv is not None:
                await self._release(turn.conv.id, turn.lock)
        # The quota: what the request used, or nothing when the pool refused it before doing any work.
        did_work = status == 200 or completion > 0 or status in (408, 499) or error is not None
        if turn.reservation is not None:
            await store_call(self.quotas.reconcile, turn.reservation, turn.tokens if did_work else 0)
        self._record(info.pool, status, acc)
        if status == 200 or completion:
            self.metrics.tenant_usage(turn.tenant, turn.prompt_tokens, completion)
        if self.audit is not None:
            text = None
            if self.audit.include_text:
                b = turn.body
                text = [m.model_dump() for m in b.messages] if isinstance(b, ChatCompletionRequest) else b.prompt
            self.audit.write(AuditRecord(
                tenant=turn.tenant, request_id=info.request_id, conversation=info.conversation, pool=info.pool,
                version=info.version, prompt_tokens=turn.prompt_tokens, completion_tokens=completion,
                cached_tokens=turn.cached_tokens, status=status, finish_reason=turn.finish_reason,
                duration_s=round(time.perf_counter() - acc.t0, 4), replica=self.replica, prompt=text,
                output=["".join(turn.texts[i]) for i in sorted(turn.texts)] if self.audit.include_text else None))
        return error

    @api.post("/v1/conversations", status_code=201)
    async def create_conversation(self, request: Request) -> JSONResponse:
        """A new server-side conversation; send its turns with ``sinkserve.conversation_id``."""
        tenant = self.auth.tenant_of(self._authorize(request))
        conv = await self._store(self.conversations.create, tenant)
        return JSONResponse(conv.summary(), status_code=201, headers={CONVERSATION_HEADER: conv.id})

    @api.get("/v1/conversations/{conversation_id}")
    async def get_conversation(self, conversation_id: str, request: Request) -> JSONResponse:
        """The conversation's turns (tokens, cached tokens, pool and policy of each), not its text."""
        tenant = self.auth.tenant_of(self._authorize(request))
        conv = await self._store(self.conversations.load, conversation_id, tenant)
        if conv is None:
            raise APIError(404, f"conversation {conversation_id!r} does not exist (or has expired)", "conversation_id", "not_found")
        return JSONResponse(conv.summary())

    @api.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(self, conversation_id: str, request: Request) -> JSONResponse:
        tenant = self.auth.tenant_of(self._authorize(request))
        if not await self._store(self.conversations.delete, conversation_id, tenant):
            raise APIError(404, f"conversation {conversation_id!r} does not exist (or has expired)", "conversation_id", "not_found")
        return JSONResponse({"id": conversation_id, "object": "conversation", "deleted": True})

    # ---- asynchronous jobs (app/state/jobs.py) ---------------------------------------------------------

    @api.post("/v1/jobs", status_code=202)
    async def submit_job(self, request: Request) -> JSONResponse:
        """``{"endpoint": "/v1/completions" | "/v1/chat/completions", "body": {...}}`` -> a job id.
        The body is planned now (a 4xx names its field) and runs later on the jobs pool."""
        key = self._authorize(request)
        tenant = self.auth.tenant_of(key)
        # Parsed on the planning threads like any request body (up to max_body_bytes of JSON).
        body = await self.plan_pool.run(_parse_job, await read_body(request, self.spec.ingress.max_body_bytes))
        if body.stream or body.n != 1 or (body.sinkserve and body.sinkserve.conversation_id):
            raise APIError(400, "a job is one choice, not streamed, outside conversations (stream, n, conversation_id)", "body")
        pool = self.spec.jobs_pool
        self._check_operator_options(key, body, self._pinned_version(body.model))
        ext = (body.sinkserve or SinkserveExtension()).model_copy(update={"pool": pool})
        body = body.model_copy(update={"sinkserve": ext})
        plan = await self.plan_pool.run(self.planner.plan, body, key, new_request_id("job"), self._pinned_version(body.model))
        reservation = None
        if self.quotas.limited(tenant):  # the prompt now; the completion with the job's result (app/state/jobs.py)
            reservation = await store_call(self.quotas.reserve, tenant, plan.info.prompt_tokens)
        try:
            job = await self._store(self.jobs.submit, tenant, plan.info.deployment, plan.info.pool, plan.request)
        except APIError:
            if reservation is not None:
                await store_call(self.quotas.reconcile, reservation, 0)
            raise
        return JSONResponse(job.view(), status_code=202)

    @api.get("/v1/jobs/{job_id}")
    async def get_job(self, job_id: str, request: Request) -> JSONResponse:
        """The job's status; its result once it succeeded, the reason once it failed."""
        tenant = self.auth.tenant_of(self._authorize(request))
        job = await self._store(self.jobs.get, job_id, tenant)
        if job is None:
            raise APIError(404, f"job {job_id!r} does not exist (or has expired)", "job_id", "not_found")
        return JSONResponse(job.view())

    @api.post("/v1/jobs/{job_id}/cancel")
    async def cancel_job(self, job_id: str, request: Request) -> JSONResponse:
        tenant = self.auth.tenant_of(self._authorize(request))
        job = await self._store(self.jobs.cancel, job_id, tenant)
        if job is None:
            raise APIError(404, f"job {job_id!r} does not exist (or has expired)", "job_id", "not_found")
        return JSONResponse(job.view())

    @api.get("/v1/tenant/usage")
    async def tenant_usage(self, request: Request) -> JSONResponse:
        """The caller's tenant: tokens used in each quota window, the limit and when it resets."""
        tenant = self.auth.tenant_of(self._authorize(request))
        usage = await self._store(self.quotas.usage, tenant)
        return JSONResponse({"tenant": tenant, "quotas": [
            {"quota": u.window.name, "used": u.used, "limit": u.limit, "resets_at": int(u.resets_at)} for u in usage]})

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
            toks = token_text(tok).texts(prompt_ids) if body.wants_logprobs() else ()
            echo = Echo(text, toks)
        return Choices(body, info, body.model or self.spec.served_model_name, echo)

    async def _choices_off_loop(self, body: Any, info: RouteInfo, prompt_ids: tuple[int, ...]) -> Choices:
        """:meth:`_choices`; with ``echo`` on the planning threads: echoing decodes the whole prompt (and
        with logprobs names each of its tokens), up to the pool's sequence limit, which would hold the
        event loop like tokenizing it did."""
        if isinstance(body, CompletionRequest) and body.echo:
            return await self.plan_pool.run(self._choices, body, info, prompt_ids)
        return self._choices(body, info, prompt_ids)

    def _model_of(self, version: str) -> str:
        return next(v.model for v in self.spec.plan.versions if v.name == version)

    async def _unary(self, gen: Any, info: RouteInfo, body: Any, chat: bool, t0: float, turn: _Turn,
                     prompt_ids: tuple[int, ...] = ()) -> Response:
        acc = _Timing(t0)
        try:
            choices = await self._choices_off_loop(body, info, prompt_ids)
            async for ev in gen:
                if isinstance(ev, APIError):
                    await self._settle(turn, ev.status, acc)
                    raise ev
                acc.add(ev)
                choices.add(ev)
                turn.add(ev)
        except asyncio.CancelledError:
            # client went away; stream_plan cancels the pool call
            self._spawn(self._settle(turn, 499, acc))
            raise
        except APIError as e:  # the pool's (settled above), or the planning threads saturated (echo)
            await gen.aclose()  # a pool call still running is cancelled
            await self._settle(turn, e.status, acc)
            raise
        error = await self._settle(turn, 200, acc)
        if error is not None:
            raise error  # a 200 never hides a lost write
        return JSONResponse(json.loads(choices.response().model_dump_json()), headers=_route_headers(info))

    async def _sse(self, gen: Any, info: RouteInfo, body: Any, chat: bool, t0: float, turn: _Turn,
                   prompt_ids: tuple[int, ...] = (), pending: "asyncio.Future[Any] | None" = None) -> AsyncIterator[bytes]:
        """The SSE body. ``pending``: the stream's first event, still awaited when the headers went out.
        Until the first token (prefill, a wait for a slot) a keep-alive comment goes out every
        ``keepalive_s`` of silence; after it the events are read directly (a task per read costs
        ~16 us a delta, too much for every token of every stream)."""
        turn.body_started = True
        acc = _Timing(t0)
        choices: Choices | None = None  # built inside the try: a failure there still settles the turn
        status = 200
        unsaved = False  # the turn finished but could not be saved: an error event ends the stream, not [DONE]
        nxt = pending

        async def handle(ev: Any) -> tuple[list[bytes], bool]:
            """The SSE bytes for one event, and whether the stream ends with it."""
            nonlocal status, unsaved
            if isinstance(ev, RouteInfo):
                turn.plan = replace(turn.plan, info=ev)  # the pool that serves it (after a failover, another)
                return [], False  # the headers already carried it
            if isinstance(ev, APIError):
                # Headers are gone already; the error travels as a final SSE event.
                status = ev.status
                await self._settle(turn, status, acc)
                return [sse_event(ev.body())], True
            acc.add(ev)
            choices.add(ev)
            turn.add(ev)
            chunk = choices.chunk(ev)
            out = [sse_event(chunk)] if chunk is not None else []
            if ev.finished:
                error = await self._settle(turn, 200, acc)  # the turn is stored before the client sees the end
                if error is not None:
                    status, unsaved = error.status, True
                    return out + [sse_event(error.body())], True  # no [DONE]: the turn was not saved
                if body.include_usage():
                    out.append(sse_event(choices.usage_chunk()))
            return out, ev.finished

        try:
            choices = await self._choices_off_loop(body, info, prompt_ids)
            for first in choices.first_chunks():
                yield sse_event(first)
            stop = False
            while not stop and acc.ttft is None:  # until the first token: reads with keep-alives
                if nxt is None:
                    nxt = asyncio.ensure_future(gen.__anext__())
                done, _ = await asyncio.wait({nxt}, timeout=self.spec.ingress.keepalive_s)
                if not done:
                    yield KEEPALIVE
                    continue
                try:
                    ev = nxt.result()
                except StopAsyncIteration:
                    stop = True
                    break
                finally:
                    nxt = None
                out, stop = await handle(ev)
                for b in out:
                    yield b
            if not stop:
                async for ev in gen:
                    out, stop = await handle(ev)
                    for b in out:
                        yield b
                    if stop:
                        break
            if not unsaved:
                yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # client disconnected mid-stream
            raise
        except APIError as e:  # the planning threads saturated while building the echo
            status, unsaved = e.status, True
            yield sse_event(e.body())
        except Exception as e:  # a bug on this path: the stream ends with an error event, the turn is settled below
            logger.exception("request %s: stream failed in the ingress", info.request_id)
            status, unsaved = 500, True
            yield sse_event(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body())
        finally:
            if nxt is not None:
                nxt.cancel()
                try:
                    await nxt
                except BaseException:  # noqa: BLE001 - the cancelled read
                    pass
            if not turn.finished:
                await gen.aclose()  # cancels the pool call: abort in the engine now
            if not turn.settled:
                self._spawn(self._settle(turn, status, acc))
