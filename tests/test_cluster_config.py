"""The local cluster's pure parts (no Ray started): its layout and ports, the config it deploys, the
placement resources that config asks for, and the refusal of SQLite on more than one node. The cluster
itself runs in tests/cluster (``make test-cluster``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.cli.serve import validate_apps
from app.cli.local_cluster import (HEAD_RESOURCE, NODE_MARK_ENV, POOL_RESOURCE, LocalCluster, cluster_config, kill_marked,
                         local_layout, marked_pids)
from app.pool.placement import PlacementError, app_needs, check_placement, pack_replicas
from app.settings import AppArgs

REPO = Path(__file__).resolve().parents[1]


def prod() -> dict:
    return yaml.safe_load((REPO / "serve_configs/prod.yaml").read_text())


def test_layout_ports_are_distinct_and_per_node() -> None:
    lay = local_layout(port_base=26000, http_port=8000)
    assert [n.name for n in lay.nodes] == ["head", "worker-a", "worker-b"]
    assert [n.http_port for n in lay.nodes] == [8000, 8001, 8002]
    ports = lay.all_ports
    assert len(ports) == len(set(ports))
    ranges = [lay.worker_ports(n) for n in lay.nodes]
    assert ranges == [(26100, 26199), (26200, 26299), (26300, 26399)]
    assert not any(lo <= p <= hi for p in ports for lo, hi in ranges)  # no fixed port inside a worker range
    assert dict(lay.node("worker-b").resources) == {POOL_RESOURCE: 1000.0, "node_b": 1000.0}
    with pytest.raises(KeyError, match="worker-c"):
        lay.node("worker-c")


def test_node_commands_and_environment(tmp_path: Path) -> None:
    c = LocalCluster(local_layout(26000, 8000), tmp_path, env={"SINKSERVE_API_KEYS": "k"}, temp_dir="/tmp/ssc-x")
    head, worker = c.layout.nodes[0], c.layout.nodes[2]
    hc, wc = c.node_command(head), c.node_command(worker)
    assert "--head" in hc and "--port" in hc and "--block" in hc
    assert wc[wc.index("--address") + 1].endswith(":26000") and "--head" not in wc
    assert wc[wc.index("--node-manager-port") + 1] == "26041"
    he, we = c.node_env(head), c.node_env(worker)
    assert we["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] == "8002" and "RAY_SERVE_WORKER_PROXY_HTTP_PORT" not in he
    assert he["RAY_SERVE_HAPROXY_STATS_PORT"] != we["RAY_SERVE_HAPROXY_STATS_PORT"]
    assert we["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and we["SINKSERVE_API_KEYS"] == "k"
    assert we["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "ray_auth_token")  # its own token, not ~/.ray's
    assert "RAY_health_check_period_ms" in he and "RAY_health_check_period_ms" not in we
    assert we[NODE_MARK_ENV] == f"{tmp_path.resolve()}#worker-b" != he[NODE_MARK_ENV]
    with pytest.raises(ValueError, match="head"):
        c.kill_node("head")


def test_cluster_config_is_valid_and_placed() -> None:
    cfg = cluster_config(prod(), "redis://127.0.0.1:26060/0")
    assert cfg["http_options"]["host"] == "0.0.0.0" and cfg["proxy_location"] == "EveryNode"
    args = cfg["applications"][0]["args"]
    assert args["store"] == {"kind": "redis", "url": "redis://127.0.0.1:26060/0"} and args["multi_node"] is True
    assert args["ingress"]["resources"] == {HEAD_RESOURCE: 1.0}
    assert all(p["resources"] == {POOL_RESOURCE: 1.0} for p in args["pools"])
    assert validate_apps(cfg) is None
    assert prod()["applications"][0]["args"]["store"]["kind"] == "sqlite"  # the input is not changed


def test_multi_node_config_refuses_sqlite() -> None:
    cfg = cluster_config(prod(), "redis://h:6379/0")
    cfg["applications"][0]["args"]["store"] = {"kind": "sqlite", "data_dir": "/tmp/x"}
    problem = validate_apps(cfg)
    assert problem is not None and "store: kind 'sqlite'" in problem and "multi_node: true" in problem


def test_cluster_needs_place_ingress_on_head_and_pools_on_workers() -> None:
    args = AppArgs.model_validate(cluster_config(prod(), "redis://h:6379/0")["applications"][0]["args"])
    lay = local_layout()
    nodes = [{"CPU": n.num_cpus, **dict(n.resources)} for n in lay.nodes]
    cluster = {"CPU": 5.0, HEAD_RESOURCE: 1000.0, POOL_RESOURCE: 2000.0, "node_a": 1000.0, "node_b": 1000.0}
    needs = app_needs(args, 0.0)
    report = check_placement(needs, cluster, nodes)
    assert report.packs_at_min
    placed = pack_replicas(needs, nodes)
    assert sorted(i for name, i in placed if name in ("Ingress", "StatsHub")) == [0, 0, 0]
    assert all(i in (1, 2) for name, i in placed if name.startswith("pool-"))
    # Without a node offering the head's resource, nothing can hold an ingress replica: refused, named.
    with pytest.raises(PlacementError, match="Ingress: one replica needs .*sinkserve_head"):
        check_placement(needs, cluster, nodes[1:])


def test_tp_replica_resources_sit_in_its_first_bundle() -> None:
    from app.builder import pool_options

    cfg = cluster_config(prod(), "redis://h:6379/0")
    long = next(p for p in cfg["applications"][0]["args"]["pools"] if p["name"] == "long")
    long["engine"]["tensor_parallel_size"] = 2
    args = AppArgs.model_validate(cfg["applications"][0]["args"])
    pool = next(p for p in args.pools if p.name == "long")
    opts = pool_options(pool, "cpu")
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 0.1, POOL_RESOURCE: 1.0}, {"CPU": 0.1}, {"CPU": 0.1}]
    short = next(p for p in args.pools if p.name == "short")
    assert pool_options(short, "cpu")["ray_actor_options"]["resources"] == {POOL_RESOURCE: 1.0}
    # One TP replica needs all three bundles on one worker: a worker too small for them is refused.
    nodes = [{"CPU": 1.0, HEAD_RESOURCE: 1000.0}, {"CPU": 0.25, POOL_RESOURCE: 1000.0}, {"CPU": 0.25, POOL_RESOURCE: 1000.0}]
    cluster = {"CPU": 1.5, HEAD_RESOURCE: 1000.0, POOL_RESOURCE: 2000.0}
    with pytest.raises(PlacementError, match=r"pool-long-v1: one replica needs .*\(STRICT_PACK\)"):
        check_placement(app_needs(args, 0.0), cluster, nodes)


def test_resources_field_refuses_cpu_and_zero() -> None:
    with pytest.raises(ValueError, match="'CPU' is set by num_cpus"):
        AppArgs(pools=[{"name": "a", "resources": {"CPU": 1}}])
    with pytest.raises(ValueError, match="must be above 0"):
        AppArgs(ingress={"resources": {"x": 0}})


def test_a_node_is_every_process_carrying_its_mark(tmp_path: Path) -> None:
    """What outlives a node's process group (a Ray worker in its own group, HAProxy) is found by the
    mark its environment inherited, and killed with the node; an unmarked process is left alone."""
    import os
    import signal
    import subprocess
    import sys

    mark = f"{tmp_path}#worker-a"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    marked = subprocess.Popen(sleeper, env={**os.environ, NODE_MARK_ENV: mark}, start_new_session=True)
    other = subprocess.Popen(sleeper, env={**os.environ, NODE_MARK_ENV: mark + "x"})
    try:
        assert marked_pids(mark) == [marked.pid]
        kill_marked(mark, signal.SIGKILL)
        assert marked.wait(10) == -signal.SIGKILL and other.poll() is None
    finally:
        for p in (marked, other):
            p.kill()
            p.wait()


def test_cluster_puts_session_kv_in_its_redis_unless_a_backend_is_named() -> None:
    cfg = prod()
    pools = cfg["applications"][0]["args"]["pools"]
    pools[0].setdefault("engine", {})["session_kv"] = {"enabled": True, "path": "/tmp/kv"}
    pools[1].setdefault("engine", {})["session_kv"] = {"enabled": True, "backend": "directory", "path": "/mnt/shared"}
    out = cluster_config(cfg, "redis://127.0.0.1:26060/0")["applications"][0]["args"]["pools"]
    assert out[0]["engine"]["session_kv"] == {"enabled": True, "path": "/tmp/kv", "backend": "redis",
                                              "url": "redis://127.0.0.1:26060/0"}
    assert out[1]["engine"]["session_kv"] == {"enabled": True, "backend": "directory", "path": "/mnt/shared"}
    assert all("session_kv" not in (p.get("engine") or {}) for p in out[2:])
    del pools[1]["engine"]["session_kv"]  # that pool runs sparse attention, which session KV refuses
    args = AppArgs.model_validate(cluster_config(cfg, "redis://h:6379/0")["applications"][0]["args"])
    assert args.pools[0].engine_config("m", "cpu").session_kv.backend == "redis"
