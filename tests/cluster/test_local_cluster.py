"""A 3-node Ray cluster on this machine (``sinkserve cluster up``: real ``ray start`` processes, a real
``redis-server``), serving prod.yaml with the reference model, driven over HTTP through each node's proxy.

One cluster for the module (a few minutes on 2 cores: ``make test-cluster``; skipped by ``make test``).
The config is prod.yaml with two changes that make placement assertable and the node loss cheap to
recover from: the short pool runs 2 replicas (SPREAD: one per worker), the long pool TP=2 (its three
bundles STRICT_PACK on one worker); jobs run on the short pool, one at a time per replica.

- every proxy (head, worker-a, worker-b) serves models, completions and streams; a conversation started
  through one proxy continues through another (the store is Redis, shared);
- the ingress and the stats hub run on the head, the short replicas on both workers, the TP group on one;
- a worker node killed (its whole ``ray start`` process group, SIGKILL) while streams are in flight: each
  stream ends with an SSE error event and ``[DONE]`` or finishes (none hangs, none is cut), new requests
  succeed, the conversation takes its next turn, the job running there is re-queued exactly once and
  succeeds, the other job is not re-run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import warnings
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app.cli.local_cluster import LocalCluster, local_layout, port_free

REPO = Path(__file__).resolve().parents[2]
KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT_S = 420

pytestmark = pytest.mark.skipif(os.environ.get("SINKSERVE_CLUSTER_TEST") != "1",
                                reason="starts a 3-node Ray cluster (minutes): run with `make test-cluster`")


def free_layout_ports() -> tuple[int, int]:
    """(port base, HTTP port) with every port of the layout free."""
    for _ in range(50):
        # Below the ephemeral port range (app.cli.local_cluster.DEFAULT_PORT_BASE says why).
        base, http = random.randrange(20000, 32000, 400), random.randrange(10000, 19990, 10)
        if all(port_free(p) for p in local_layout(base, http).all_ports):
            return base, http
    raise RuntimeError("no free port range")


def cluster_test_config(path: Path) -> Path:
    cfg = yaml.safe_load((REPO / "serve_configs/prod.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["ingress"]["num_replicas"] = 1
    args["ingress"].pop("rate_limit_rps")  # the test's own bursts are not the point
    args["audit"] = {"path": None}
    pools = {p["name"]: p for p in args["pools"]}
    pools["short"]["autoscaling"] = {"min_replicas": 2, "max_replicas": 2}
    pools["short"]["engine"]["max_num_seqs"] = 16
    # The node-loss test's 6,000-token streams must outlive the kill, not the pool's 120 s timeout on a
    # loaded host (one ended with a 408 at load ~130).
    pools["short"]["timeout_s"] = 600
    # Streams and jobs that outlast the kill (the reference model decodes ~200 tokens/s) need more
    # than its 1,024-token context: the short pool evicts here, as the long one does in prod.
    pools["short"]["engine"]["cache_policy"] = {"eviction_policy": "sliding_window", "protected_positions": [0, 1, 2, 3]}
    pools["long"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 1}
    pools["long"]["engine"]["tensor_parallel_size"] = 2
    # int(16 x 0.05) = 0 -> one job at a time per short replica: two jobs run on two replicas.
    args["jobs"] = {"pool": "short", "max_share": 0.05}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the cluster's store needs it")
    tmp = tmp_path_factory.mktemp("cluster")
    state = tmp / "state"
    base, http = free_layout_ports()
    env = {**os.environ, "SINKSERVE_API_KEYS": KEY, "SINKSERVE_OPERATOR_KEYS": KEY, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "app.cli", "cluster", "up", str(cluster_test_config(tmp / "cluster.yaml")),
                               "--model", "reference", "--port", str(http), "--port-base", str(base),
                               "--state-dir", str(state), "--timeout", str(START_TIMEOUT_S)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S + 120)
        if proc.returncode != 0:
            raise AssertionError(f"cluster up failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        print(f"cluster up in {time.monotonic() - t0:.0f}s")
        yield LocalCluster.load(state)
    finally:
        if (state / "state.json").exists():  # whatever happened, nothing it started keeps running
            LocalCluster.load(state).stop()


def urls(c: LocalCluster) -> dict[str, str]:
    return {n.name: f"http://127.0.0.1:{n.http_port}" for n in c.layout.nodes}


def test_every_node_proxy_serves(cluster: LocalCluster) -> None:
    conv = None
    for name, base in urls(cluster).items():
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
            assert c.get("/readyz").status_code == 200, name
            assert c.get("/v1/models").json()["data"][0]["id"] == "sinkserve", name
            r = c.post("/v1/completions", json={"prompt": f"hello from {name}", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, (name, r.text)
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as s:
                body = s.read().decode()
            assert s.status_code == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body, (name, body)
            # One conversation, a turn through every node's proxy: the store is shared (Redis).
            if conv is None:
                conv = c.post("/v1/conversations").json()["id"]
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"turn via {name}"}],
                                                     "max_tokens": 3, "sinkserve": {"conversation_id": conv}})
            assert r.status_code == 200, (name, r.text)
    turns = httpx.get(urls(cluster)["head"] + f"/v1/conversations/{conv}", headers=AUTH, timeout=30).json()["turns"]
    assert len(turns) == 3


def test_placement_across_nodes(cluster: LocalCluster) -> None:
    where = cluster.where()
    assert where["nodes"] == ["head", "worker-a", "worker-b"]
    replicas = {}
    for a in where["actors"]:
        if a["name"].startswith("SERVE_REPLICA::"):
            replicas.setdefault(a["name"].split("#")[1], []).append(a["node"])
    assert replicas["Ingress"] == ["head"] and replicas["StatsHub"] == ["head"], replicas
    assert sorted(replicas["pool-short-v1"]) == ["worker-a", "worker-b"], replicas  # one per worker (SPREAD)
    assert replicas["pool-long-v1"][0].startswith("worker-"), replicas
    tp = [g for g in where["groups"] if g["strategy"] == "STRICT_PACK"]
    assert len(tp) == 1 and len(tp[0]["nodes"]) == 3, where["groups"]  # the replica + 2 ranks
    assert set(tp[0]["nodes"]) == {replicas["pool-long-v1"][0]}, tp  # packed on the replica's node
    ranks = [a["node"] for a in where["actors"] if "TPWorker" in a["class"] or "Rank" in a["class"]]
    assert ranks and set(ranks) == {replicas["pool-long-v1"][0]}, where["actors"]


# Long enough that every stream and job still runs when the node is killed (the kill waits for all six
# streams' first tokens): at 1,500 / 3,000 tokens the streams on the lost replica had finished by then
# (twice at load 6-12, 2026-12-03). The short pool evicts, so the context does not bound them.
STREAM_TOKENS = 6000
JOB_TOKENS = 6000


def stream_until_end(base: str, i: int, first_token: threading.Event, out: dict) -> None:
    """A long stream pinned to the short pool; records how it ended."""
    body = b""
    try:
        with httpx.stream("POST", base + "/v1/completions", headers=AUTH, timeout=httpx.Timeout(90, read=60), json={
                "prompt": f"stream {i}", "max_tokens": STREAM_TOKENS, "stream": True,
                "sinkserve": {"ignore_eos": True, "pool": "short"}}) as r:
            for chunk in r.iter_bytes():
                body += chunk
                if b'"text"' in body:
                    first_token.set()
        out[i] = ("ok", r.status_code, time.monotonic(), body.decode(errors="replace"))
    except httpx.HTTPError as e:
        out[i] = ("exc", repr(e), time.monotonic(), body.decode(errors="replace"))


def job_view(base: str, job_id: str) -> dict:
    return httpx.get(f"{base}/v1/jobs/{job_id}", headers=AUTH, timeout=30).json()


def test_worker_node_loss(cluster: LocalCluster) -> None:
    head = urls(cluster)["head"]
    where = cluster.where()
    tp_node = next(g["nodes"][0] for g in where["groups"] if g["strategy"] == "STRICT_PACK")
    victim = "worker-a" if tp_node == "worker-b" else "worker-b"  # a short replica, not the TP group
    conv = httpx.post(head + "/v1/conversations", headers=AUTH, timeout=30).json()["id"]
    turn = {"messages": [{"role": "user", "content": "remember me"}], "max_tokens": 3,
            "sinkserve": {"conversation_id": conv}}
    assert httpx.post(head + "/v1/chat/completions", headers=AUTH, json=turn, timeout=60).status_code == 200
    # Two jobs, long enough to be running at the kill: one per short replica (one slot each).
    jobs = []
    for i in range(2):
        r = httpx.post(head + "/v1/jobs", headers=AUTH, timeout=30, json={"endpoint": "/v1/completions", "body": {
            "prompt": f"job {i}", "max_tokens": JOB_TOKENS, "sinkserve": {"ignore_eos": True}}})
        assert r.status_code == 202, r.text
        jobs.append(r.json()["id"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(job_view(head, j)["status"] != "running" for j in jobs):
        time.sleep(0.5)
    assert all(job_view(head, j)["status"] == "running" for j in jobs), [job_view(head, j) for j in jobs]
    streams: dict[int, tuple] = {}
    firsts = [threading.Event() for _ in range(6)]
    threads = [threading.Thread(target=stream_until_end, args=(head, i, firsts[i], streams)) for i in range(6)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in firsts), streams

    killed_at = time.monotonic()
    cluster.kill_node(victim)
    for t in threads:
        t.join(300)  # the survivors' 6,000 tokens, on a loaded host
    assert not any(t.is_alive() for t in threads), "a stream hung after the node was lost"
    lost = 0
    for i, (kind, status, ended, body) in streams.items():
        assert kind == "ok" and status == 200, (i, kind, status, body[-300:])  # never a cut connection
        assert body.rstrip().endswith("data: [DONE]"), (i, body[-300:])
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        if "error" in events[-1]:
            lost += 1
            assert "lost the replica" in events[-1]["error"]["message"], events[-1]
            assert ended - killed_at < 60, ended - killed_at
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    if lost == 0:
        # Which replica a stream lands on is Serve's choice: on a loaded 2-core host the six streams were
        # all served elsewhere, or done, before the kill in 3 of 4 runs (2026-12-03). The mid-stream SSE
        # error itself is covered by the drill (load_tests/node_loss_drill.py); the rest still holds here.
        warnings.warn("no stream was on the lost node's replica: the mid-stream error path was not exercised")

    # New requests succeed (Serve drops the lost replica; the other worker's replica serves).
    recovered, answers = None, []
    while time.monotonic() - killed_at < 120:
        try:
            r = httpx.post(head + "/v1/completions", headers=AUTH, timeout=60,
                           json={"prompt": "after", "max_tokens": 4, "sinkserve": {"pool": "short"}})
        except httpx.HTTPError as e:
            answers.append((round(time.monotonic() - killed_at, 1), repr(e)[:120]))
            continue
        answers.append((round(time.monotonic() - killed_at, 1), r.status_code, r.text[:160]))
        if r.status_code == 200:
            recovered = time.monotonic() - killed_at
            break
        time.sleep(0.5)
    assert recovered is not None, f"no request to the short pool succeeded within 120 s of the node loss: {answers[-5:]}"
    print(f"node loss: first new request to the short pool served {recovered:.1f}s after the kill")
    r = httpx.post(head + "/v1/chat/completions", headers=AUTH, json=turn, timeout=60)
    assert r.status_code == 200, r.text
    assert len(httpx.get(f"{head}/v1/conversations/{conv}", headers=AUTH, timeout=30).json()["turns"]) == 2

    # Jobs: the one whose replica was lost runs again once (lease lapsed -> re-queued), the other once.
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and any(job_view(head, j)["status"] not in ("succeeded", "failed") for j in jobs):
        time.sleep(1.0)
    views = [job_view(head, j) for j in jobs]
    assert all(v["status"] == "succeeded" for v in views), views
    assert sorted(v["attempts"] for v in views) == [1, 2], views
    assert all(v["result"]["usage"]["completion_tokens"] == JOB_TOKENS for v in views), views
