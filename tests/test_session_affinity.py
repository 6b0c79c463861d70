"""The pool's session router (app/pool/affinity.py): a turn goes to the replica its rendezvous rank prefers,
and past the pool's ``affinity_max_load`` to the least loaded replica instead (which restores the
session's KV from the store), configured from the yaml's pool settings."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.pool.affinity import SessionAffinityRouter, ranked
from app.builder import pool_options
from app.events import PoolRequest
from app.settings import PoolArgs
from engine import SamplingParams


class Loads:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id.unique_id)


def choose(max_load, loads: dict[str, int], session: str = "c-42", probed: dict[str, int] | None = None) -> list[str]:
    router = object.__new__(SessionAffinityRouter)
    router.max_load = max_load
    router._replica_queue_len_cache = Loads(loads)
    probes: list[int] = []

    async def probe(replicas, backoff_index):  # the replicas' own answer (default: what the cache says)
        probes.append(len(replicas))
        live = (loads or {}) if probed is None else probed
        return [(r, live.get(r.replica_id.unique_id)) for r in replicas]

    router._probe_queue_lens = probe
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("r1", "r2", "r3")]
    pending = SimpleNamespace(args=(PoolRequest("q", (1, 2), SamplingParams(), affinity=session),))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_a_session_stays_on_its_replica_below_the_load_threshold_and_moves_past_it() -> None:
    order = ranked("c-42", ["r1", "r2", "r3"])
    first = order[0]
    assert choose(None, {first: 50}) == order  # no threshold: stays (Serve refuses when it is full)
    assert choose(4, {first: 3}) == order
    idle = order[2]
    moved = choose(4, {order[0]: 4, order[1]: 2, idle: 0})
    assert moved == [idle, order[0], order[1]]


def test_a_turn_leaves_its_replica_only_when_a_fresh_probe_agrees() -> None:
    """Serve's queue-length cache drifts up (it counts sends, misses completions): a cache that says the
    first choice is full is checked by probing, and the probe's answer decides."""
    order = ranked("c-42", ["r1", "r2", "r3"])
    stale = {order[0]: 9, order[1]: 9, order[2]: 8}
    assert choose(4, stale, probed={order[0]: 0, order[1]: 0, order[2]: 0}) == order
    assert choose(4, stale, probed={order[0]: 5, order[1]: 0, order[2]: 1}) == [order[1], order[0], order[2]]
    assert choose(4, stale, probed={order[1]: 0, order[2]: 0}) == order  # first choice did not answer: stays


def test_the_threshold_is_a_pool_setting_passed_to_the_router() -> None:
    pool = PoolArgs(name="chat", affinity_max_load=8, engine={"session_kv": {"enabled": True, "path": "/tmp/x"}})
    opts = pool_options(pool, "cpu")
    assert opts["request_router_config"].request_router_kwargs == {"max_load": 8}


def test_the_router_serve_pickles_by_value_registers_where_the_ingress_looks() -> None:
    """Serve cloudpickles the router's module by value (``RequestRouterConfig``) and loads it in the
    ingress's process. Pickling must work while this process already holds routers, and a router of the
    loaded copy must register in ``app.pool.router_view``, the module ``Ingress._deployment_ready`` reads, not
    in a copy of it: a fresh process (where the copy is a new class) counts the replicas Serve gave it."""
    import subprocess
    import sys
    from pathlib import Path

    from ray.serve.config import RequestRouterConfig

    from app.pool import router_view
    from app.pool.affinity import ROUTER_PATH

    held = object.__new__(SessionAffinityRouter)  # a router already live in this process
    held._replicas = {}
    router_view.register("pool-held-v1", held)
    try:
        config = RequestRouterConfig(request_router_class=ROUTER_PATH, request_router_kwargs={"max_load": 4})
    finally:
        router_view._ROUTERS.pop("pool-held-v1", None)
    loader = """
import sys
from types import SimpleNamespace
from ray import cloudpickle
cls = cloudpickle.loads(sys.stdin.buffer.read())
router = object.__new__(cls)
router._deployment_id = SimpleNamespace(name="pool-x-v1", app_name="sinkserve")
router.initialize_state(max_load=4)
router._replicas = {"r1": object(), "r2": object()}
from app.pool import affinity, router_view
print(cls is not affinity.SessionAffinityRouter, router.max_load, router_view.routed_replicas("pool-x-v1"),
      router_view.routed_replicas("pool-never-called-v1"))
"""
    out = subprocess.run([sys.executable, "-c", loader], input=config._serialized_request_router_cls,
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == ["True", "4", "2", "None"]
