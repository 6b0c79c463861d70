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
STATS_HUB_CPUS = 0.05  # app.pool.hub.StatsHub's ray_actor_options


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
        bundles = (tuple({"CPU": pool.num_cpus, **pool.resources}.items()),) + (worker,) * pool.tensor_parallel_size
    else:
        bundles = (tuple({"CPU": pool.num_cpus, **gpu, **pool.resources}.items()),)
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
    deps.append(DeploymentNeeds("Ingress", "cpu", (tuple({"CPU": ingress.num_cpus, **ingress.resources}.items()),), False,
                                ingress.num_replicas, ingress.num_replicas))
    deps.append(DeploymentNeeds("StatsHub", "cpu", (tuple({"CPU": STATS_HUB_CPUS, **ingress.resources}.items()),),
                                False, 1, 1))
    return AppNeeds(tuple(deps))


@dataclass(frozen=True)
class PlacementReport:
    needs: AppNeeds
    cluster: dict[str, float]
    fits_at_max: bool
    # Whether the minimum replicas pack onto the nodes one replica per node slot (first fit, largest
    # first); None: no per-node resources given. False is logged, not refused: first fit is a heuristic.
    packs_at_min: bool | None = None

    def describe(self) -> str:
        tail = "" if self.fits_at_max else " (full autoscale will not fit: replicas beyond it stay pending)"
        if self.packs_at_min is False:
            tail += " (the minimum replicas did not pack onto the nodes by first fit: some may stay pending)"
        return f"{self.needs.describe()}\ncluster has {fmt(self.cluster)}{tail}"


def _fits(need: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(v <= node.get(k, 0.0) + 1e-9 for k, v in need.items())


def pack_replicas(needs: AppNeeds, nodes: Sequence[Mapping[str, float]]) -> list[tuple[str, int]] | None:
    """Each minimum replica on one node (a replica is all its bundles: STRICT_PACK for TP, one bundle
    else), first fit, largest first. Returns ``(deployment, node index)`` per replica, or None when
    first fit leaves one unplaced. Example, nodes ``[{CPU: 1, head: 1}, {CPU: 2, pool: 1}]``::

        Ingress x2 (0.1 CPU, head 0.01) -> node 0, node 0
        pool-long x1 (0.1 + 2 x 0.1 CPU, pool 0.01, STRICT_PACK) -> node 1   (all three bundles)
    """
    free = [dict(n) for n in nodes]
    replicas = [(d.name, d.per_replica) for d in needs.deployments for _ in range(d.min_replicas)]
    replicas.sort(key=lambda r: -sum(r[1].values()))
    out = []
    for name, per in replicas:
        i = next((i for i, n in enumerate(free) if _fits(per, n)), None)
        if i is None:
            return None
        for k, v in per.items():
            free[i][k] = free[i].get(k, 0.0) - v
        out.append((name, i))
    return out


def check_placement(needs: AppNeeds, cluster: Mapping[str, float],
                    nodes: Sequence[Mapping[str, float]] | None = None) -> PlacementReport:
    """Refuse (``PlacementError``, with the numbers) when ``cluster`` (total resources, as
    ``ray.cluster_resources()``) cannot hold the minimum replicas, or when no node in ``nodes`` (per-node
    resources, if given) can hold one replica of a deployment -- all its bundles for a STRICT_PACK (TP)
    replica, its custom resources (``resources:``) included. Full autoscale not fitting, or first fit not
    packing the minimum, is reported, not refused: the minimum serves, extra replicas wait for capacity."""
    short = {k: v for k, v in needs.at_min.items() if v > cluster.get(k, 0.0) + 1e-9}
    if short:
        detail = "; ".join(f"{k}: needs {v:g}, cluster has {cluster.get(k, 0.0):g}" for k, v in sorted(short.items()))
        raise PlacementError(f"the cluster cannot place this application at its minimum replicas ({detail})\n"
                             f"{needs.describe()}")
    packs = None
    if nodes:
        for d in needs.deployments:
            if d.min_replicas == 0:
                continue
            per = d.per_replica
            if not any(_fits(per, n) for n in nodes):
                biggest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
                what = " (STRICT_PACK)" if d.strict_pack else ""
                raise PlacementError(f"{d.name}: one replica needs {fmt(per)} on one node{what}; no node has it "
                                     f"(the largest has {fmt(biggest)})")
        packs = pack_replicas(needs, nodes) is not None
    fits = all(v <= cluster.get(k, 0.0) + 1e-9 for k, v in needs.at_max.items())
    return PlacementReport(needs, dict(cluster), fits, packs)
