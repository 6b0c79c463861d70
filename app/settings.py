"""Application settings: pydantic at the edge (``AppArgs`` is the ``args:`` block of a Serve config),
frozen dataclasses inside (:class:`PoolSpec`, :class:`PlanSpec`, :class:`IngressSpec`). The args models are
frozen too: a spec carries the configured block whole (``IngressArgs``, ``StoreArgs``, ...) and adds only
what the builder resolved (engine configs, limits, buckets), so no setting is copied into a second class.

A pool's ``engine:`` block *is* the engine's own configuration (``EngineConfig`` and its
``cache_policy``), validated by the engine's classes when the args are parsed -- so a misspelled key
in ``prod.yaml`` fails ``serve run`` / ``sinkserve serve`` with its path named, before any replica
starts. Only two engine fields are filled in by the app: ``model`` (per version) and
``device: auto`` (cuda when the cluster has GPUs, else cpu).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.config import DEFAULT_MODEL, EngineConfig, REPO_ROOT
from engine.config_io import engine_config_from_dict
from engine.errors import ConfigError
from engine.limits import EngineLimits, derive_limits, read_model_config

__all__ = ["AppArgs", "PoolArgs", "pool_limits", "check_limits", "PoolSpec", "PlanSpec", "IngressSpec", "REPO_ROOT"]


class _Strict(BaseModel):
    # Unknown keys are rejected so a typo in a YAML file fails loudly at deploy time.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingArgs(_Strict):
    """Serve autoscaling on queue depth (ongoing requests per replica)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = None
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingArgs":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is less than min_replicas ({self.min_replicas})")
        return self

    def to_serve(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class VersionArgs(_Strict):
    """One model version; traffic is split between versions by ``weight`` (canary / rollback)."""

    name: str = Field("v1", pattern=r"^[A-Za-z0-9_.-]+$")
    model: str | None = None  # None: the application's ``model``
    weight: float = Field(1.0, ge=0)


class PoolArgs(_Strict):
    """One length bucket, served by its own deployment per model version.

    Serving fields (bucket bound, timeout, queue caps, replicas, CPUs) sit here; everything about
    the engine sits under ``engine:`` with ``EngineConfig``'s own field names.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    # None: what the pool's engine accepts for the model, less one output token (engine/limits.py):
    # the trained context for a pool that keeps its full cache, max_stream_tokens for one that evicts or
    # runs selected memory (sparse.position_mode compact): EngineLimits.max_prompt_tokens.
    max_prompt_tokens: int | None = Field(None, gt=0)
    timeout_s: float = Field(120.0, gt=0)
    # Soft timeout: at this age a request's generation ends cleanly with what it has produced so far
    # and finish_reason "time_limit" (docs/serving.md), instead of a 408 at timeout_s. None: off.
    soft_timeout_s: float | None = Field(None, gt=0)
    # Model versions served by this bucket (None: all). Lets a canary run on one bucket only.
    versions: list[str] | None = None
    num_replicas: int = Field(1, ge=1)
    # max_tokens of a chat request that sets none: at most this many (and at most what the prompt leaves
    # of the engine's limit). A pool that evicts streams up to max_stream_tokens (about 1M), so without a
    # cap a request that forgot max_tokens would run for minutes. Shown on /v1/models.
    default_max_tokens: int = Field(1024, ge=1)
    autoscaling: AutoscalingArgs | None = None
    max_ongoing_requests: int = Field(64, gt=0)
    max_queued_requests: int = Field(128, ge=-1)
    # A session's turn leaves the replica its rendezvous rank prefers once that replica holds this many
    # requests, for the least loaded one (with engine.memory.session_kv on, the turn's KV follows it from the
    # store; app/pool/affinity.py). None: it stays until Serve refuses it (max_ongoing + max_queued).
    affinity_max_load: int | None = Field(None, gt=0)
    # Requests without a session go to the replica a hash of their first this many prompt tokens (whole
    # KV blocks of engine.block_size) prefers, so requests sharing a system prompt or document meet its
    # cached blocks (app/pool/prefix_affinity.py). Needs affinity_max_load: one popular prefix would otherwise
    # queue every request on one replica. None (the default): power of two choices.
    prefix_affinity_tokens: int | None = Field(None, gt=0)
    num_cpus: float = Field(0.1, ge=0)  # the replica (scheduler, KV bookkeeping; the model at TP=1)
    worker_num_cpus: float = Field(0.1, ge=0)  # each tensor-parallel worker
    # Custom Ray resources each replica asks for (a TP replica: its bundle 0, so STRICT_PACK puts all its
    # ranks on that node too): where it may run, e.g. {sinkserve_pool: 1} on a cluster whose worker
    # nodes offer sinkserve_pool (app/cli/local_cluster.py). Empty: any node.
    resources: dict[str, float] = Field(default_factory=dict)
    # An engine that holds work and has not stepped for this long is hung: killed and restarted, its
    # requests answered 503 (engine/frontend/engine_process.py). Above the longest step a pool can take.
    engine_watchdog_s: float = Field(60.0, gt=0)
    engine: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "model" in v:
            raise ValueError("engine.model: set the model per version (versions[].model) or for the app (model)")
        if v.get("device", "auto") not in ("auto", "cpu") and not str(v["device"]).startswith("cuda"):
            raise ValueError(f"engine.device: must be 'auto', 'cpu' or 'cuda[:N]', got {v['device']!r}")
        try:
            engine_config_from_dict(v, device="cpu")  # every other field, as the replica will build it
        except ConfigError as e:
            raise ValueError(f"engine.{e.field}: {e.message}") from None
        except TypeError as e:  # a value of the wrong shape (e.g. a list where a number goes)
            raise ValueError(f"engine: {e}") from None
        return v

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "resources")

    @model_validator(mode="after")
    def _prefix_affinity(self) -> "PoolArgs":
        n = self.prefix_affinity_tokens
        if n is None:
            return self
        if self.affinity_max_load is None:
            raise ValueError("prefix_affinity_tokens: needs affinity_max_load (requests sharing one popular prefix "
                             "would otherwise all queue on one replica); set e.g. affinity_max_load: 8")
        block = self.block_size
        if n % block:
            raise ValueError(f"prefix_affinity_tokens: must be a multiple of this pool's KV block size "
                             f"(engine.block_size {block}), got {n}")
        return self

    @model_validator(mode="after")
    def _soft(self) -> "PoolArgs":
        if self.soft_timeout_s is not None and self.soft_timeout_s >= self.timeout_s:
            raise ValueError(f"soft_timeout_s ({self.soft_timeout_s:g}) must be below timeout_s ({self.timeout_s:g})")
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine.get("tensor_parallel_size", 1))

    @property
    def block_size(self) -> int:
        """The pool's KV block size as its engine resolves it (set, or the default for its kv_cache_dtype)."""
        return int(engine_config_from_dict(self.engine, device="cpu").block_size)

    @property
    def cache_policy(self) -> dict[str, Any]:
        return dict(self.engine.get("cache_policy", {}))

    def engine_config(self, model: str, device: str) -> EngineConfig:
        """This pool's engine for ``model`` on ``device`` (``auto`` already resolved)."""
        return engine_config_from_dict(self.engine, model=model, device=device)


class IngressArgs(_Strict):
    num_replicas: int = Field(2, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    # Custom Ray resources of each ingress replica and of the stats hub (where they may run), e.g.
    # {sinkserve_head: 1}: on a cluster the ingress stays on the head node, so losing a worker node never
    # cuts a client's HTTP stream -- it ends with an SSE error event instead (docs/cluster.md).
    resources: dict[str, float] = Field(default_factory=dict)
    # Per API key, per ingress replica (replicas share no state, so the cluster-wide rate is
    # roughly rate_limit_rps * num_replicas).
    rate_limit_rps: float | None = Field(None, gt=0)
    rate_limit_burst: int = Field(20, gt=0)
    # Most passages one request may send in sinkserve.passages (each is tokenized and scored here).
    max_passages: int = Field(256, ge=1)
    # An SSE comment (": keep-alive") after this many seconds without an event, so gateways with a
    # read timeout (often 5-60 s) do not cut a stream whose prefill or queueing is slow.
    keepalive_s: float = Field(2.0, gt=0)
    # Larger request bodies are refused with 413 before they are parsed (app/http/request_body.py).
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    # Parsing, tokenizing and planning run on this many threads per replica, off the event loop, with
    # at most plan_max_waiting more waiting (then 503); app/plan/plan_pool.py.
    plan_threads: int = Field(2, ge=1)
    plan_max_waiting: int = Field(64, ge=0)
    # A request that no replica of its pool has taken after this many seconds, while the stats hub sees
    # no ready replica of that pool (its only replica's node was lost; Serve holds the call until a
    # replacement runs, a minute on a loaded host), stops waiting: it fails over to another pool that
    # fits it, or gets a 503 with Retry-After naming the pool (app/pool/streaming.py, app/pool/failover.py).
    replica_wait_s: float = Field(3.0, gt=0)

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v, "ingress.resources")


def _check_resources(v: dict[str, float], field: str) -> dict[str, float]:
    for name, amount in v.items():
        if name in ("CPU", "GPU", "memory"):
            raise ValueError(f"{field}: {name!r} is set by num_cpus / the device, not here")
        if amount <= 0:
            raise ValueError(f"{field}.{name}: must be above 0, got {amount:g}")
    return v


class StoreArgs(_Strict):
    """Where sessions, tenant token counters and jobs live (``app/state/``)."""

    kind: Literal["sqlite", "redis"] = "sqlite"
    # sqlite: the file is <data_dir>/sinkserve.sqlite3 (WAL mode); every ingress replica on the node shares it.
    data_dir: str = "~/.sinkserve/data"
    # redis: for apps on more than one node, e.g. redis://10.0.0.5:6379/0
    url: str | None = None
    prefix: str = Field("sinkserve:", max_length=64)

    @model_validator(mode="after")
    def _url(self) -> "StoreArgs":
        if self.kind == "redis" and not self.url:
            raise ValueError("store.url: required when store.kind is 'redis' (e.g. redis://127.0.0.1:6379/0)")
        return self


class TenantArgs(_Strict):
    """A tenant's token quotas (prompt + completion tokens); None: no limit on that window."""

    tokens_per_minute: int | None = Field(None, gt=0)
    tokens_per_day: int | None = Field(None, gt=0)


class QuotaArgs(_Strict):
    """How tenant quotas behave when the store is down (``quotas:`` in the yaml; app/state/quotas.py)."""

    # true: a limited tenant's request is refused (503, Retry-After) while the store cannot reserve
    # its tokens; false (the default): it is let through and the log says so. Unlimited tenants are
    # never affected.
    fail_closed: bool = False


SINGLE_NODE_STORE = ("store: kind 'sqlite' keeps conversations, quotas and jobs in a file on one node; an app on "
                     "more than one node needs kind 'redis' (store: {kind: redis, url: redis://host:6379/0})")


class SessionArgs(_Strict):
    """Server-side conversations (``app/state/conversations.py``); ``sessions:`` in the yaml."""

    ttl_s: float = Field(7 * 86400.0, gt=0)  # a session unused this long is forgotten


class JobsArgs(_Strict):
    """The asynchronous job API (``app/state/jobs.py``): which pool runs jobs and how much of it they may take."""

    pool: str | None = None  # None: the pool with the largest prompt bound
    # Of each replica's sequence slots (engine.max_num_seqs), the share jobs may hold at once (at least one).
    max_share: float = Field(0.25, gt=0, le=1)
    # A job's wall clock once running: past it the runner stops the generation and the job ends
    # "failed" with the partial text and finish_reason "time_limit" (a huge max_tokens on an evicting
    # pool could otherwise run for hours with no client).
    timeout_s: float = Field(1800.0, gt=0)


class AuditArgs(_Strict):
    """The request audit log (``app/http/audit.py``): JSON lines; never the API key."""

    path: str | None = None  # None: no audit log
    include_text: bool = False  # prompt and output text in each record


class AppArgs(_Strict):
    """Everything ``serve_configs/*.yaml`` may set under ``args:``."""

    model: str = DEFAULT_MODEL
    served_model_name: str = "sinkserve"
    # "disabled" must be written explicitly; keys never come from this file (env or key file only).
    auth: Literal["enabled", "disabled"] = "enabled"
    ingress: IngressArgs = IngressArgs()
    versions: list[VersionArgs] = Field(default_factory=lambda: [VersionArgs()])
    pools: list[PoolArgs] = Field(
        default_factory=lambda: [
            PoolArgs(name="short"),
            PoolArgs(name="long", engine={"cache_policy": {"eviction_policy": "sliding_window"}}),
        ]
    )
    stats_push_interval_s: float = Field(1.0, gt=0)
    # A replica that has not pushed its snapshot for this long stops counting as ready (app/pool/hub.py): how
    # soon the ingress learns a pool has no live replica (failover, replica_wait_s) and /readyz shows it.
    # Many push intervals: on a 2-core host at load 20-28 pushes were late by more than 5 s, and a 5 s
    # TTL flipped live pools to "not ready" (18 of 242 Locust requests refused, docs/cluster.md).
    stats_ttl_s: float = Field(15.0, gt=0)
    store: StoreArgs = StoreArgs()
    # Quotas by tenant name; API keys name their tenant (app/http/auth.py). A tenant not listed has none.
    tenants: dict[str, TenantArgs] = Field(default_factory=dict)
    sessions: SessionArgs = SessionArgs()
    audit: AuditArgs = AuditArgs()
    jobs: JobsArgs = JobsArgs()
    quotas: QuotaArgs = QuotaArgs()
    # The app's replicas may run on more than one node (also assumed when Ray reports more than one
    # alive node at build time): the store must then be Redis.
    multi_node: bool = False

    @model_validator(mode="after")
    def _ttl_spans_pushes(self) -> "AppArgs":
        if self.stats_ttl_s < 2 * self.stats_push_interval_s:
            raise ValueError(f"stats_ttl_s ({self.stats_ttl_s:g}) must be at least twice stats_push_interval_s "
                             f"({self.stats_push_interval_s:g}): one late push would mark a live replica not ready")
        return self

    @model_validator(mode="after")
    def _store_spans_nodes(self) -> "AppArgs":
        if self.multi_node and self.store.kind == "sqlite":
            raise ValueError(SINGLE_NODE_STORE + " (multi_node: true)")
        return self

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, tenants: dict[str, TenantArgs]) -> dict[str, TenantArgs]:
        import re

        bad = [t for t in tenants if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", t)]
        if bad:
            raise ValueError(f"tenant names must match [A-Za-z0-9_.-]{{1,64}}, got {bad}")
        return tenants

    @field_validator("pools")
    @classmethod
    def _pools(cls, pools: list[PoolArgs]) -> list[PoolArgs]:
        if not pools:
            raise ValueError("at least one pool is required")
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        # A bound left to the model is unknown here (0); the builder orders buckets by their resolved bounds.
        return sorted(pools, key=lambda p: p.max_prompt_tokens or 0)

    @field_validator("versions")
    @classmethod
    def _versions(cls, versions: list[VersionArgs]) -> list[VersionArgs]:
        if not versions:
            raise ValueError("at least one model version is required")
        names = [v.name for v in versions]
        if len(set(names)) != len(names):
            raise ValueError(f"version names must be unique, got {names}")
        if sum(v.weight for v in versions) <= 0:
            raise ValueError("at least one version needs a weight above 0")
        return versions

    @model_validator(mode="after")
    def _jobs_pool(self) -> "AppArgs":
        names = [p.name for p in self.pools]
        if self.jobs.pool is not None and self.jobs.pool not in names:
            raise ValueError(f"jobs.pool: unknown pool {self.jobs.pool!r}; pools are {names}")
        return self

    @model_validator(mode="after")
    def _pool_versions(self) -> "AppArgs":
        known = {v.name for v in self.versions}
        for p in self.pools:
            unknown = sorted(set(p.versions or ()) - known)
            if unknown:
                raise ValueError(f"pool {p.name!r} names unknown versions {unknown}; versions are {sorted(known)}")
            if p.versions is not None and not p.versions:
                raise ValueError(f"pool {p.name!r} serves no version")
        return self


def pool_limits(pool: PoolArgs, model: str) -> EngineLimits:
    """The pool's engine limits for ``model`` (``engine/limits.py``: the same derivation the engine runs),
    with a configured pool bound checked against them. ``ConfigError`` names the pool, the field and the
    model's context."""
    config = pool.engine_config(model, "cpu")  # the device changes no token count
    try:
        limits = derive_limits(config, read_model_config(model))
    except ConfigError as e:
        raise ConfigError(f"pools[{pool.name}].engine.{e.field}", f"{e.message} (model {model})") from None
    if pool.max_prompt_tokens is not None and pool.max_prompt_tokens > limits.max_prompt_tokens:
        raise ConfigError(
            f"pools[{pool.name}].max_prompt_tokens",
            f"{pool.max_prompt_tokens} is more than this pool's engine accepts for model {model}: "
            f"{limits.max_prompt_tokens} ({limits.limit_field} {limits.max_seq_len} minus one output token; trained "
            f"context {limits.trained_context} tokens); lower it, or leave it out to derive it from the model")
    return limits


def check_limits(args: AppArgs) -> None:
    """Every pool's limits for every model version it serves (``pool_limits``): the build-time refusals,
    run by ``sinkserve serve`` before Serve starts so a bad value is one line, not a traceback."""
    from engine.errors import ModelLoadError
    from engine.worker.model_store import resolve_model

    for pool in args.pools:
        for v in args.versions:
            if pool.versions is None or v.name in pool.versions:
                try:
                    model = resolve_model(v.model or args.model, fetch=False, fallback=False)
                except ModelLoadError:
                    continue  # not installed yet: checked again once it is resolved (fetched or fallen back)
                pool_limits(pool, model)


# ---- inside the application: frozen dataclasses -------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    name: str
    max_prompt_tokens: int
    timeout_s: float
    versions: tuple[str, ...] | None = None  # None: every version has a deployment for this bucket
    # The pool engine's sequence limit (prompt + output), EngineLimits.max_seq_len of its engines (the
    # tightest): max_model_len, or max_stream_tokens for a pool that evicts or runs selected memory
    # (position_mode compact). Chat's default max_tokens is what a prompt leaves of it (None: unknown).
    max_seq_len: int | None = None
    # EngineLimits.streams: the pool evicts or runs selected memory, so a conversation may go on past its
    # prompt bound (up to max_seq_len).
    streams: bool = False
    policy_version: str | None = None  # the pool's configured cache policy (content hash)
    soft_timeout_s: float | None = None
    default_max_tokens: int | None = None  # the pool's cap on a chat's default max_tokens (None: no cap)
    block_size: int = 16  # the pool engine's KV block size (what a prefix key hashes whole blocks of)
    prefix_affinity_tokens: int | None = None  # PoolArgs.prefix_affinity_tokens (None: no prefix key)


@dataclass(frozen=True)
class VersionSpec:
    name: str
    model: str
    weight: float
    # The model's weights fingerprint (engine/worker/weights.py: from its SHA256SUMS manifest), or None.
    fingerprint: str | None = None
    # The model class of its config.json (LlamaForCausalLM, AttnResForCausalLM, ...), or None.
    architecture: str | None = None


@dataclass(frozen=True)
class PoolSpec:
    """What one LLMServer deployment needs: its bucket, its model version and its engine."""

    pool: PoolArgs  # as configured (worker_num_cpus, engine_watchdog_s, ...); ``engine`` is its resolved engine
    version: str
    engine: EngineConfig
    stats_push_interval_s: float = 1.0
    # The job pool's replicas run queued jobs (app/state/jobs.py), at most job_slots at once; 0: none.
    job_slots: int = 0
    jobs: JobsArgs = JobsArgs()
    store: StoreArgs | None = None
    tenants: tuple[tuple[str, TenantArgs], ...] = ()  # to charge a finished job to its tenant

    @property
    def bucket(self) -> str:
        return self.pool.name

    @property
    def deployment_name(self) -> str:
        return pool_deployment_name(self.bucket, self.version)


@dataclass(frozen=True)
class PlanSpec:
    """What the ingress's planner needs: buckets, versions (their tokenizers) and rate limits."""

    buckets: tuple[BucketSpec, ...]
    versions: tuple[VersionSpec, ...]
    ingress: IngressArgs = IngressArgs()  # rate limits, max_passages


def pool_deployment_name(bucket: str, version: str) -> str:
    return f"pool-{bucket}-{version}"


@dataclass(frozen=True)
class IngressSpec:
    auth: str  # "enabled" | "disabled"
    served_model_name: str
    plan: PlanSpec
    pool_deployments: tuple[str, ...]
    stats_push_interval_s: float = 1.0
    kv_cache: tuple[tuple[str, str], ...] = ()  # (pool, kv_cache_dtype), for /v1/models
    limits: tuple[tuple[str, EngineLimits], ...] = ()  # (pool, its engine's resolved limits), for /v1/models
    # The app's own blocks as configured (frozen pydantic models, passed whole rather than copied field by field).
    ingress: IngressArgs = IngressArgs()  # keepalive_s, max_body_bytes, plan_threads, plan_max_waiting
    store: StoreArgs = StoreArgs()
    tenants: tuple[tuple[str, TenantArgs], ...] = ()
    sessions: SessionArgs = SessionArgs()
    audit: AuditArgs = AuditArgs()
    quotas: QuotaArgs = QuotaArgs()
    jobs_pool: str | None = None

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.plan.versions)
