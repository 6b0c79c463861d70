"""Serve application builder: ``import_path: app.builder:build_app`` with pydantic ``args``.

Topology (one Serve application)::

    Ingress xN  ->  Router xN  ->  pool-<bucket>-<version>  (LLMServer, one deployment each)
         \\____________ StatsHub x1 (metrics/readiness snapshots) ___________/
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from app.auth import resolve_auth
from app.hub import StatsHub
from app.ingress import Ingress
from app.router import Router
from app.server import LLMServer
from app.settings import (
    AppArgs,
    BucketSpec,
    IngressSpec,
    PoolArgs,
    PoolSpec,
    RouterSpec,
    VersionSpec,
    resolve_model_path,
)

logger = logging.getLogger("sinkserve.builder")

_ENGINE_KEYS = ("dtype", "max_model_len", "num_kv_blocks", "block_size", "max_num_seqs",
                "max_num_batched_tokens", "enable_prefix_caching", "attention_backend")


def model_max_len(model_dir: str) -> int | None:
    """``max_position_embeddings`` from the model's config.json, if it can be read."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("max_position_embeddings")


def clamp_pool(pool: PoolArgs, model_len: int | None) -> PoolArgs:
    """A bucket cannot accept prompts its engine would refuse: cap ``max_prompt_tokens`` at the
    engine's limit less one token for the output. That limit is ``max_model_len`` (the pool's own,
    else the model's), or ``max_stream_tokens`` for a sliding-window pool, which streams far past it."""
    from engine.cache_policy import CachePolicy

    policy = pool.cache_policy
    if policy.get("eviction_policy") == "sliding_window":
        limit: int | None = int(policy.get("max_stream_tokens", CachePolicy.max_stream_tokens))
    else:
        limit = pool.max_model_len or model_len
    if limit is None or pool.max_prompt_tokens < limit:
        return pool
    logger.warning("pool %s: max_prompt_tokens %d capped to %d (engine limit %d)", pool.name,
                   pool.max_prompt_tokens, limit - 1, limit)
    return pool.model_copy(update={"max_prompt_tokens": limit - 1})


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


def resolve_device(pool: PoolArgs, gpus: float) -> str:
    """``auto`` places workers on GPUs when the cluster has them, else on CPUs."""
    if pool.device != "auto":
        return pool.device
    return "cuda" if gpus > 0 else "cpu"


def pool_options(pool: PoolArgs, device: str, low_latency: bool = False) -> dict[str, Any]:
    """Serve deployment options for one pool.

    TP > 1: the replica gets a STRICT_PACK placement group, bundle 0 for the replica actor (it runs
    the scheduler, not the model) and one bundle per tensor-parallel worker (with a GPU each on GPU
    clusters), so all ranks of a replica land on one node and gloo/NCCL stay intra-node.
    """
    opts: dict[str, Any] = {
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "user_config": {"cache_policy": dict(pool.cache_policy)},
        "graceful_shutdown_wait_loop_s": 2.0,
        "graceful_shutdown_timeout_s": max(30.0, pool.timeout_s),
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
    }
    worker = {"CPU": pool.worker_num_cpus, **({"GPU": 1.0} if device == "cuda" else {})}
    if pool.tensor_parallel_size > 1:
        opts["ray_actor_options"] = actor_options(pool.num_cpus, low_latency)
        opts["placement_group_bundles"] = [{"CPU": pool.num_cpus}] + [worker] * pool.tensor_parallel_size
        opts["placement_group_strategy"] = "STRICT_PACK"
    else:
        opts["ray_actor_options"] = actor_options(pool.num_cpus, low_latency,
                                                  **({"num_gpus": 1.0} if device == "cuda" else {}))
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = pool.autoscaling.to_serve()
        opts["num_replicas"] = None  # autoscaling decides
    else:
        opts["num_replicas"] = pool.num_replicas
    return {k: v for k, v in opts.items() if v is not None}


LOW_LATENCY_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def actor_options(num_cpus: float, low_latency: bool, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": num_cpus, **extra}
    if low_latency:
        opts["runtime_env"] = {"env_vars": dict(LOW_LATENCY_ENV)}
    return opts


def build_app(args: AppArgs) -> Application:
    """Build the application from validated args (Serve validates a YAML ``args:`` dict into
    ``AppArgs`` through the type hint)."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    # Refuse to build an unauthenticated server unless the config says so explicitly; the ingress
    # replicas check again when they start (their environment is what counts).
    resolve_auth(args.auth)
    gpus = cluster_gpus()
    versions = tuple(
        VersionSpec(v.name, resolve_model_path(v.model or args.model), v.weight) for v in args.versions
    )
    hub = StatsHub.options(name="StatsHub").bind()
    model_len = min((n for n in (model_max_len(v.model) for v in versions) if n), default=None)
    pool_args = [clamp_pool(p, model_len) for p in args.pools]
    pools: dict[str, Application] = {}
    for pool in pool_args:
        device = resolve_device(pool, gpus)
        for v in versions:
            if pool.versions is not None and v.name not in pool.versions:
                continue
            spec = PoolSpec(
                bucket=pool.name,
                version=v.name,
                model=v.model,
                tensor_parallel_size=pool.tensor_parallel_size,
                device=device,
                engine_kwargs=tuple((k, getattr(pool, k)) for k in _ENGINE_KEYS if getattr(pool, k) is not None),
                cache_policy=tuple(sorted(pool.cache_policy.items())),
                stats_push_interval_s=args.stats_push_interval_s,
                worker_num_cpus=pool.worker_num_cpus,
                engine_process=pool.engine_process,
            )
            dep = serve.deployment(LLMServer).options(name=spec.deployment_name, **pool_options(pool, device, args.low_latency))
            pools[spec.deployment_name] = dep.bind(spec, hub)
            logger.info("pool %s: model %s, tp=%d on %s, weight %g", spec.deployment_name, v.model,
                        pool.tensor_parallel_size, device, v.weight)
    router_spec = RouterSpec(
        buckets=tuple(
            BucketSpec(p.name, p.max_prompt_tokens, p.timeout_s, tuple(p.versions) if p.versions is not None else None)
            for p in pool_args
        ),
        versions=versions,
        tokenizer_path=versions[0].model,
        rate_limit_rps=args.router.rate_limit_rps,
        rate_limit_burst=args.router.rate_limit_burst,
        router_replicas=args.router.num_replicas,
        grpc_handles=args.grpc_handles,
    )
    router = serve.deployment(Router).options(
        name="Router",
        num_replicas=args.router.num_replicas,
        ray_actor_options=actor_options(args.router.num_cpus, args.low_latency),
        max_ongoing_requests=1000,  # routers only await pools; queue caps live on the pools
    ).bind(router_spec, pools)
    ingress_spec = IngressSpec(
        auth=args.auth,
        served_model_name=args.served_model_name,
        versions=tuple(v.name for v in versions),
        pool_deployments=tuple(pools),
        stats_push_interval_s=args.stats_push_interval_s,
        grpc_handles=args.grpc_handles,
        token_bus=args.token_bus,
        local_router=router_spec if args.router.plan_in == "ingress" else None,
    )
    return serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=args.ingress.num_replicas,
        ray_actor_options=actor_options(args.ingress.num_cpus, args.low_latency),
        max_ongoing_requests=1000,
    ).bind(ingress_spec, router, pools, hub)
