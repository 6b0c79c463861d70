"""What an application needs from the Ray cluster, and whether the cluster can place it.

Pure arithmetic over validated ``AppArgs`` (no Ray, no torch), mirroring how ``app.builder`` asks for
resources: every pool deployment (one per pool x model version) has replicas made of placement bundles

* TP = 1: one bundle ``{CPU: num_cpus, GPU: 1 on CUDA}`` (the replica runs the model, or its engine child does);
* TP > 1: ``{CPU: num_cpus}`` for the replica (scheduler only, no GPU) plus one ``{CPU: worker_num_cpus,
  GPU: 1 on CUDA}`` per rank, STRICT_PACK, so one node must hold a whole replica;

plus the ingress and stats-hub replicas (CPU only). Serve starts at the minimum replica count
(autoscaling's ``initial_replicas`` or ``min_replicas``, else ``num_replicas``) and may grow to
``max_replicas``. A cluster that cannot hold the minimum never becomes ready -- placement groups wait
forever -- so ``check_placement`` refuses it up front, with the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.settings import AppArgs, PoolArgs, pool_deployment_name

GPUS_PER_WORKER = 1.0  # what app.builder gives each model worker on CUDA
STATS_HUB_CPUS = 0.05  # app.hub.StatsHub's ray_actor_options


class PlacementError(ValueError):
    """The cluster cannot place the application; the message has the numbers."""


def pool_device(pool: PoolArgs, cluster_gpus: float) -> str:
    """``engine.device: auto`` (the default) places the engine on GPUs when the cluster has any, else on
    CPUs (as ``app.builder.resolve_device``)."""
    device = str(pool.engine.get("device", "auto"))
    if device != "auto":
        return device
    return "cuda" if cluster_gpus > 0 else "cpu"


@dataclass(frozen=True)
class DeploymentNeeds:
    """One deployment: the bundles of one replica and how many replicas it runs."""

    name: str
    device: str
    bundles: tuple[tuple[tuple[str, float], ...], ...]
    strict_pack: bool
    min_replicas: int
    max_replicas: int

    @property
    def per_replica(self) -> dict[str, float]:
        return add(*(dict(b) for b in self.bundles))

    def total(self, replicas: int) -> dict[str, float]:
        return {k: v * replicas for k, v in self.per_replica.items()}


@dataclass(frozen=True)
class AppNeeds:
    """Every deployment of an application with its resources at minimum and at full autoscale."""

    deployments: tuple[DeploymentNeeds, ...]

    @property
    def at_min(self) -> dict[str, float]:
        return add(*(d.total(d.min_replicas) for d in self.deployments))

    @property
    def at_max(self) -> dict[str, float]:
        return add(*(d.total(d.max_replicas) for d in self.deployments))

    def describe(self) -> str:
        lines = [f"needs {fmt(self.at_min)} at minimum replicas, {fmt(self.at_max)} at full autoscale"]
        for d in self.deployments:
            lines.append(f"  {d.name}: {d.min_replicas}..{d.max_replicas} x ({fmt(d.per_replica)}) on {d.device}")
        return "\n".join(lines)


def add(*resources: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            out[k] = round(out.get(k, 0.0) + v, 6)
    return {k: v for k, v in out.items() if v}


def fmt(resources: Mapping[str, float]) -> str:
    keys = sorted(resources, key=lambda k: (k != "GPU", k != "CPU", k))
    return ", ".join(f"{resources[k]:g} {k}" + ("s" if k in ("GPU", "CPU") and resources[k] != 1 else "")
                     for k in keys) or "nothing"


def replica_bounds(pool: PoolArgs) -> tuple[int, int]:
    """(replicas Serve starts with, replicas it may grow to)."""
    a = pool.autoscaling
    if a is None:
        return pool.num_replicas, pool.num_replicas
    start = a.initial_replicas if a.initial_replicas is not None else a.min_replicas
    return start, a.max_replicas


def pool_needs(pool: PoolArgs, version: str, cluster_gpus: float) -> DeploymentNeeds:
    device = pool_device(pool, cluster_gpus)
    gpu = {"GPU": GPUS_PER_WORKER} if device.startswith("cuda") else {}
    if pool.tensor_parallel_size > 1:
        worker = tuple({"CPU": pool.worker_num_cpus, **gpu}.items())
        bundles = (tuple({"CPU": pool.num_cpus}.items()),) + (worker,) * pool.tensor_parallel_size
    else:
        bundles = (tuple({"CPU": pool.num_cpus, **gpu}.items()),)
    low, high = replica_bounds(pool)
    return DeploymentNeeds(pool_deployment_name(pool.name, version), device, bundles,
                           pool.tensor_parallel_size > 1, low, high)


def app_needs(args: AppArgs, cluster_gpus: float) -> AppNeeds:
    """Resources of every deployment ``app.builder.build_app(args)`` creates on a cluster with
    ``cluster_gpus`` GPUs (which decides ``device: auto``)."""
    deps = []
    for pool in args.pools:
        for v in args.versions:
            if pool.versions is None or v.name in pool.versions:
                deps.append(pool_needs(pool, v.name, cluster_gpus))
    ingress = args.ingress
    deps.append(DeploymentNeeds("Ingress", "cpu", (tuple({"CPU": ingress.num_cpus}.items()),), False,
                                ingress.num_replicas, ingress.num_replicas))
    deps.append(DeploymentNeeds("StatsHub", "cpu", (tuple({"CPU": STATS_HUB_CPUS}.items()),), False, 1, 1))
    return AppNeeds(tuple(deps))


@dataclass(frozen=True)
class PlacementReport:
    needs: AppNeeds
    cluster: dict[str, float]
    fits_at_max: bool

    def describe(self) -> str:
        tail = "" if self.fits_at_max else " (full autoscale will not fit: replicas beyond it stay pending)"
        return f"{self.needs.describe()}\ncluster has {fmt(self.cluster)}{tail}"


def check_placement(needs: AppNeeds, cluster: Mapping[str, float],
                    nodes: Sequence[Mapping[str, float]] | None = None) -> PlacementReport:
    """Refuse (``PlacementError``, with the numbers) when ``cluster`` (total resources, as
    ``ray.cluster_resources()``) cannot hold the minimum replicas, or when no node in ``nodes`` (per-node
    resources, if given) can hold one STRICT_PACK replica. Full autoscale not fitting is reported, not
    refused: the minimum serves, extra replicas wait for capacity."""
    short = {k: v for k, v in needs.at_min.items() if v > cluster.get(k, 0.0) + 1e-9}
    if short:
        detail = "; ".join(f"{k}: needs {v:g}, cluster has {cluster.get(k, 0.0):g}" for k, v in sorted(short.items()))
        raise PlacementError(f"the cluster cannot place this application at its minimum replicas ({detail})\n"
                             f"{needs.describe()}")
    if nodes:
        for d in needs.deployments:
            if not d.strict_pack or d.min_replicas == 0:
                continue
            per = d.per_replica
            if not any(all(per[k] <= n.get(k, 0.0) + 1e-9 for k in per) for n in nodes):
                biggest = max(nodes, key=lambda n: n.get("GPU", 0.0))
                raise PlacementError(f"{d.name}: one replica needs {fmt(per)} on one node (STRICT_PACK); "
                                     f"the largest node has {fmt(biggest)}")
    fits = all(v <= cluster.get(k, 0.0) + 1e-9 for k, v in needs.at_max.items())
    return PlacementReport(needs, dict(cluster), fits)
