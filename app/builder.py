"""Serve application builder: ``import_path: app.builder:build_app`` with pydantic ``args``.

Topology (one Serve application)::

    HAProxy -> Ingress xN (auth, plan, SSE) -> pool-<bucket>-<version> (LLMServer, one deployment each)
                   \\__________ StatsHub x1 (metrics / readiness snapshots) __________/
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.http.auth import resolve_auth
from app.pool.hub import StatsHub
from app.http.ingress import Ingress
from app.pool.placement import STATS_HUB_CPUS, app_needs, check_placement, pool_device
from app.pool.server import LLMServer
from app.pool.affinity import ROUTER_PATH
from app.settings import SINGLE_NODE_STORE, AppArgs, BucketSpec, IngressSpec, PlanSpec, PoolArgs, PoolSpec, VersionSpec, pool_limits
from engine.limits import EngineLimits, read_model_config
from engine.worker.model_store import describe, resolve_model

logger = logging.getLogger("sinkserve.builder")

# Serve's same-loop settings (measured: docs/serving_benchmark.md): user code and the handle router
# run on the replica's main event loop, two cross-thread hops fewer per deployment. Safe because every
# deployment is async and the engine steps in its own process or thread.
SAME_LOOP_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def model_architecture(model_dir: str) -> str | None:
    """The model class named in config.json (e.g. ``AttnResForCausalLM``), for ``/v1/models``."""
    archs = read_model_config(model_dir).get("architectures") or [None]
    return archs[0]


def bucket_spec(p: PoolArgs, limits: Sequence[EngineLimits], policy_version: str) -> BucketSpec:
    """What the planner knows about one pool: its bound (configured, else the tightest of its versions'
    engines) and its engines' sequence limit."""
    max_seq = min(lim.max_seq_len for lim in limits)
    bound = p.max_prompt_tokens if p.max_prompt_tokens is not None else min(lim.max_prompt_tokens for lim in limits)
    return BucketSpec(p.name, bound, p.timeout_s, tuple(p.versions) if p.versions is not None else None,
                      max_seq, streams=limits[0].streams, policy_version=policy_version, soft_timeout_s=p.soft_timeout_s,
                      default_max_tokens=p.default_max_tokens, block_size=p.block_size,
                      prefix_affinity_tokens=p.prefix_affinity_tokens)


def cluster_resources() -> tuple[dict[str, float], list[dict[str, float]]]:
    """Total resources of the Ray cluster this driver is connected to, and each live node's
    (empty when Ray is not initialised: nothing to check against)."""
    import ray

    if not ray.is_initialized():
        return {}, []
    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    return {k: float(v) for k, v in ray.cluster_resources().items()}, nodes


def check_cluster_fits(args: AppArgs, cluster: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Refuse to build an application the cluster cannot place (its placement groups would wait
    forever and the app would never become ready): ``PlacementError`` with the numbers."""
    if not cluster:
        return
    report = check_placement(app_needs(args, cluster.get("GPU", 0.0)), cluster, nodes)
    logger.info("placement: %s", report.describe())


def actor_options(num_cpus: float, **extra: Any) -> dict[str, Any]:
    return {"num_cpus": num_cpus, "runtime_env": {"env_vars": dict(SAME_LOOP_ENV)}, **extra}


def pool_options(pool: PoolArgs, device: str) -> dict[str, Any]:
    """Serve deployment options for one pool.

    TP > 1: the replica gets a STRICT_PACK placement group, bundle 0 for the replica actor (it runs
    the scheduler, not the model) and one bundle per tensor-parallel worker (with a GPU each on GPU
    clusters), so all ranks of a replica land on one node and gloo/NCCL stay intra-node.
    """
    tp = pool.tensor_parallel_size
    opts: dict[str, Any] = {
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "user_config": {"cache_policy": pool.cache_policy},
        "graceful_shutdown_wait_loop_s": 2.0,
        "graceful_shutdown_timeout_s": max(30.0, pool.timeout_s),
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        # A conversation's turns, and requests sharing a prefix, go to the replica holding their blocks
        # (app/pool/affinity.py; the prefix key is the planner's, from the bucket's prefix_affinity_tokens).
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER_PATH, request_router_kwargs={"max_load": pool.affinity_max_load}),
    }
    gpu = device.startswith("cuda")
    worker = {"CPU": pool.worker_num_cpus, **({"GPU": 1.0} if gpu else {})}
    where = {"resources": dict(pool.resources)} if pool.resources else {}
    if tp > 1:
        # The custom resources sit in bundle 0 only: STRICT_PACK puts the ranks on that bundle's node.
        opts["ray_actor_options"] = actor_options(pool.num_cpus)
        opts["placement_group_bundles"] = [{"CPU": pool.num_cpus, **pool.resources}] + [worker] * tp
        opts["placement_group_strategy"] = "STRICT_PACK"
    else:
        opts["ray_actor_options"] = actor_options(pool.num_cpus, **({"num_gpus": 1.0} if gpu else {}), **where)
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = pool.autoscaling.to_serve()
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def check_store_fits(args: AppArgs, alive_nodes: int) -> None:
    """Refuse SQLite (one file on one node) for an app on a cluster of more than one node: each node
    would keep its own conversations, quotas and jobs."""
    if args.store.kind == "sqlite" and alive_nodes > 1:
        raise ValueError(f"{SINGLE_NODE_STORE} (Ray reports {alive_nodes} alive nodes)")


def build_app(args: AppArgs) -> Application:
    """Build the application from validated args (Serve validates a YAML ``args:`` dict into
    ``AppArgs`` through the type hint; every pool's ``engine:`` block is checked by the engine's
    own config classes there, before any replica starts)."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    # Refuse to build an unauthenticated server unless the config says so explicitly; the ingress
    # replicas check again when they start (their environment is what counts).
    resolve_auth(args.auth)
    cluster, nodes = cluster_resources()
    check_cluster_fits(args, cluster, nodes)
    check_store_fits(args, len(nodes))
    gpus = cluster.get("GPU", 0.0)
    from engine.worker.weights import fingerprint

    # Each spec (a name, a .gguf, a directory) resolved once, where the app is built, so the replicas
    # load a directory: a GGUF is converted (once: the cache), a catalog name not in the cache is
    # fetched, else the reference model is served (one log line says so). `sinkserve serve` has done
    # this before `serve run` already, so there it only finds the directories.
    model_dirs: dict[str, str] = {}
    for v in args.versions:
        spec = v.model or args.model
        if spec not in model_dirs:
            model_dirs[spec] = resolve_model(spec)
            logger.info("model %s: %s", spec, describe(model_dirs[spec]))
    models = {v.name: model_dirs[v.model or args.model] for v in args.versions}
    versions = tuple(VersionSpec(v.name, models[v.name], v.weight, fingerprint(models[v.name]),
                                 model_architecture(models[v.name])) for v in args.versions)
    # The hub runs where the ingress runs (ingress.resources: the head node of a cluster).
    hub_opts = {"ray_actor_options": {"num_cpus": STATS_HUB_CPUS, "resources": dict(args.ingress.resources)}} \
        if args.ingress.resources else {}
    hub = StatsHub.options(name="StatsHub", **hub_opts).bind(args.stats_ttl_s)
    pools: dict[str, Application] = {}
    store = args.store
    tenants = tuple(args.tenants.items())
    buckets: list[BucketSpec] = []
    limits_card: list[tuple[str, EngineLimits]] = []
    for pool in args.pools:
        served = [v for v in versions if pool.versions is None or v.name in pool.versions]
        limits = {v.name: pool_limits(pool, v.model) for v in served}
        resolved = pool.engine_config(served[0].model, "cpu")
        bucket = bucket_spec(pool, list(limits.values()), limits[served[0].name].resolve(resolved).cache_policy.version)
        buckets.append(bucket)
        for v in served:
            lim = limits[v.name]
            limits_card.append((pool.name if len(served) == 1 else f"{pool.name}@{v.name}", lim))
            logger.info("pool %s (%s, model %s): max_prompt_tokens %d%s; %s", pool.name, v.name, v.model,
                        bucket.max_prompt_tokens, "" if pool.max_prompt_tokens is not None else " (derived)", lim.describe())
    jobs_pool = args.jobs.pool or max(buckets, key=lambda b: b.max_prompt_tokens).name
    for pool in args.pools:
        device = pool_device(pool, gpus)
        for v in versions:
            if pool.versions is not None and v.name not in pool.versions:
                continue
            engine = pool.engine_config(v.model, device)
            slots = max(1, int(engine.max_num_seqs * args.jobs.max_share)) if pool.name == jobs_pool else 0
            spec = PoolSpec(pool=pool, version=v.name, engine=engine, stats_push_interval_s=args.stats_push_interval_s,
                            job_slots=slots, jobs=args.jobs, store=store if slots else None,
                            tenants=tenants if slots else ())
            dep = serve.deployment(LLMServer).options(name=spec.deployment_name, **pool_options(pool, device))
            pools[spec.deployment_name] = dep.bind(spec, hub)
            logger.info("pool %s: model %s, tp=%d on %s, weight %g", spec.deployment_name, v.model,
                        pool.tensor_parallel_size, device, v.weight)
    plan = PlanSpec(
        buckets=tuple(sorted(buckets, key=lambda b: b.max_prompt_tokens)),
        versions=versions,
        ingress=args.ingress,
    )
    ingress = IngressSpec(auth=args.auth, served_model_name=args.served_model_name, plan=plan,
                          pool_deployments=tuple(pools), stats_push_interval_s=args.stats_push_interval_s,
                          kv_cache=tuple((p.name, str(p.engine.get("kv_cache_dtype", "auto"))) for p in args.pools),
                          limits=tuple(limits_card), ingress=args.ingress, store=store, tenants=tenants,
                          sessions=args.sessions, audit=args.audit, quotas=args.quotas, jobs_pool=jobs_pool)
    return serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=args.ingress.num_replicas,
        ray_actor_options=actor_options(args.ingress.num_cpus,
                                        **({"resources": dict(args.ingress.resources)} if args.ingress.resources else {})),
        # The version weights, live-updatable: a config's `deployments: [{name: Ingress, user_config:
        # {weights: ...}}]` overrides these without restarting anything (sinkserve canary).
        user_config={"weights": {v.name: v.weight for v in versions}},
        max_ongoing_requests=1000,  # the ingress only awaits pools; queue caps live on the pools
    ).bind(ingress, pools, hub)
