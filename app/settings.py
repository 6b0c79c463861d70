"""Application arguments.

Config edges are pydantic (``AppArgs`` is what a Serve config's ``args:`` block or a Python caller
passes to :func:`app.builder.build_app`); inside the application, deployments receive frozen
dataclasses derived from them (:class:`PoolSpec`, :class:`RouterSpec`), so nothing downstream can
mutate configuration by accident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "assets/reference-model"


def resolve_model_path(path: str) -> str:
    """Make a model path absolute so every Ray worker finds it whatever its working directory.

    A relative path is tried against the current directory first, then against the project root
    (where ``assets/reference-model`` lives). Hub-style names that exist nowhere are passed through.
    """
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), PROJECT_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    return str(PROJECT_ROOT / p) if path == DEFAULT_MODEL else path


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
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is less than min_replicas ({self.min_replicas})"
            )
        return self

    def to_serve(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        return d


class VersionArgs(_Strict):
    """One model version; traffic is split between versions by ``weight`` (canary / rollback)."""

    name: str = Field("v1", pattern=r"^[A-Za-z0-9_.-]+$")
    model: str | None = None  # None: the application's ``model``
    weight: float = Field(1.0, ge=0)


class PoolArgs(_Strict):
    """One length bucket, served by its own deployment (one per model version)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    max_prompt_tokens: int = Field(gt=0)
    timeout_s: float = Field(120.0, gt=0)
    tensor_parallel_size: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str = "float32"
    max_model_len: int | None = Field(None, gt=0)
    num_kv_blocks: int | None = Field(None, gt=0)
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cache_policy: dict[str, Any] = Field(default_factory=dict)
    # Model versions served by this bucket (None: all). Lets a canary run on one bucket only.
    versions: list[str] | None = None
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingArgs | None = None
    max_ongoing_requests: int = Field(64, gt=0)
    max_queued_requests: int = Field(128, ge=-1)
    num_cpus: float = Field(0.1, ge=0)
    worker_num_cpus: float = Field(0.1, ge=0)
    # TP=1: step the engine in a child process of the replica, so the replica's serving loop never
    # waits on the model for the GIL (docs/serving.md, "The engine process"). TP>1 already runs the
    # model in its worker actors and keeps the engine in the replica.
    engine_process: bool = True


class ComponentArgs(_Strict):
    num_replicas: int = Field(2, ge=1)
    num_cpus: float = Field(0.1, ge=0)


class RouterArgs(ComponentArgs):
    # Per API key, per replica that plans (Router replicas, or ingress replicas with plan_in "ingress";
    # they share no state, so the cluster-wide rate is roughly rate_limit_rps * those replicas).
    rate_limit_rps: float | None = Field(None, gt=0)
    rate_limit_burst: int = Field(20, gt=0)
    # Where HTTP requests are planned (tokenize, bucket, version, rate): "ingress" runs the Router's
    # code inside each ingress replica; "deployment" asks a Router replica, one more Serve handle call
    # per request (~5 ms of CPU each here; docs/serving_benchmark.md). The Router deployment serves
    # handle callers that enter at it either way.
    plan_in: Literal["deployment", "ingress"] = "ingress"


class AppArgs(_Strict):
    """Everything ``serve_configs/*.yaml`` may set under ``args:``."""

    model: str = DEFAULT_MODEL
    served_model_name: str = "sinkserve"
    # "disabled" must be written explicitly; keys never come from this file (env or key file only).
    auth: Literal["enabled", "disabled"] = "enabled"
    ingress: ComponentArgs = ComponentArgs()
    router: RouterArgs = RouterArgs()
    versions: list[VersionArgs] = Field(default_factory=lambda: [VersionArgs()])
    pools: list[PoolArgs] = Field(
        default_factory=lambda: [
            PoolArgs(name="short", max_prompt_tokens=2048),
            PoolArgs(name="long", max_prompt_tokens=8192),
        ]
    )
    stats_push_interval_s: float = Field(1.0, gt=0)
    # Run user code and the handle router on the replica's main event loop (Serve's
    # "throughput optimized" knobs): removes two cross-thread hops per deployment on the request
    # path. Safe here because every deployment is async and the engine steps in its own thread.
    low_latency: bool = True
    # Request-path handle calls (ingress -> router, ingress/router -> pools) over the replicas'
    # gRPC servers instead of Ray object refs (see app.replica.data_path_handle).
    grpc_handles: bool = True
    # Token deltas travel pool -> ingress on the token bus, one frame per engine step
    # for all of an ingress replica's streams, instead of one handle item each (app/token_bus.py).
    token_bus: bool = True

    @field_validator("pools")
    @classmethod
    def _pools(cls, pools: list[PoolArgs]) -> list[PoolArgs]:
        if not pools:
            raise ValueError("at least one pool is required")
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        return sorted(pools, key=lambda p: p.max_prompt_tokens)

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
    def _pool_versions(self) -> "AppArgs":
        known = {v.name for v in self.versions}
        for p in self.pools:
            unknown = sorted(set(p.versions or ()) - known)
            if unknown:
                raise ValueError(f"pool {p.name!r} names unknown versions {unknown}; versions are {sorted(known)}")
            if p.versions is not None and not p.versions:
                raise ValueError(f"pool {p.name!r} serves no version")
        return self


# ---- inside the application: frozen dataclasses -------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    name: str
    max_prompt_tokens: int
    timeout_s: float
    versions: tuple[str, ...] | None = None  # None: every version has a deployment for this bucket


@dataclass(frozen=True)
class VersionSpec:
    name: str
    model: str
    weight: float


@dataclass(frozen=True)
class PoolSpec:
    """What one LLMServer deployment needs: its bucket, its model version and engine settings."""

    bucket: str
    version: str
    model: str
    tensor_parallel_size: int
    device: str  # "cpu" or "cuda", resolved at build time
    engine_kwargs: tuple[tuple[str, Any], ...]
    cache_policy: tuple[tuple[str, Any], ...]
    stats_push_interval_s: float = 1.0
    worker_num_cpus: float = 0.1
    engine_process: bool = True

    @property
    def deployment_name(self) -> str:
        return pool_deployment_name(self.bucket, self.version)


@dataclass(frozen=True)
class RouterSpec:
    buckets: tuple[BucketSpec, ...]
    versions: tuple[VersionSpec, ...]
    tokenizer_path: str
    rate_limit_rps: float | None = None
    rate_limit_burst: int = 20
    router_replicas: int = 1
    grpc_handles: bool = False
    extra: dict = field(default_factory=dict, compare=False)


def pool_deployment_name(bucket: str, version: str) -> str:
    return f"pool-{bucket}-{version}"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class IngressSpec:
    auth: str  # "enabled" | "disabled"
    served_model_name: str
    versions: tuple[str, ...]
    pool_deployments: tuple[str, ...]
    stats_push_interval_s: float = 1.0
    grpc_handles: bool = False
    token_bus: bool = False
    # Set when requests are planned inside the ingress (RouterArgs.plan_in == "ingress").
    local_router: RouterSpec | None = None
