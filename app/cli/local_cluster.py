"""A multi-node Ray cluster on one machine, serving a Serve config across it (``sinkserve cluster``).

Three ``ray start --block`` processes (a head and two workers, each its own node with its own logical
resources), a ``redis-server`` for the store, and the application deployed on them with ``serve run
--non-blocking``. Every port comes from one base (``--port-base``, P) and the config's HTTP port (H)::

    node      CPUs  custom resources                 HTTP proxy  HAProxy stats/metrics  Ray ports
    head      1     sinkserve_head                   H           P+8, P+9               GCS P, P+1..P+7, workers P+100..
    worker-a  2     sinkserve_pool, node_a           H+1         P+28, P+29             P+21..P+27, workers P+200..
    worker-b  2     sinkserve_pool, node_b           H+2         P+48, P+49             P+41..P+47, workers P+300..
    redis     -     -                                -           -                      P+60 (loopback)

What the config gets on a cluster (:func:`cluster_config`): the store is Redis (so is a pool's
session KV store when it is on without a backend named) and ``multi_node: true``
(SQLite is then refused, naming the field), HTTP binds every interface (HAProxy on one node reaches
ingress replicas on another: Ray warns that 127.0.0.1 cannot), the ingress and the stats hub ask for
``sinkserve_head`` (they stay on the head, so losing a worker never cuts a client's HTTP connection:
its stream ends with an SSE error event) and every pool for ``sinkserve_pool`` (pool replicas spread over
the workers; a TP replica's bundles are STRICT_PACK, so each TP group sits on one worker). Serve runs a
proxy (HAProxy) on every node that holds a replica, on the head at H and on workers at the port their
``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` names, so each node's proxy is its own door on one machine.

A node is its ``ray start --block`` process group (raylet, agents, workers): :meth:`LocalCluster.kill_node`
SIGKILLs that group, which is what losing the machine looks like to the rest (docs/cluster.md). The
Ray temp dir is the cluster's own (never another process's Ray), and :meth:`LocalCluster.stop` ends
exactly the process groups this cluster started (never ``ray stop``, which kills every Ray on the host).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.settings import REPO_ROOT

logger = logging.getLogger("sinkserve.cluster")

HEAD_RESOURCE = "sinkserve_head"  # only the head offers it: the ingress and the stats hub ask for it
POOL_RESOURCE = "sinkserve_pool"  # only workers offer it: every pool replica asks for it
RESOURCE_UNITS = 1000.0  # what a node offers; each replica asks for 1, so this never limits replica counts
WORKER_PORTS = 100  # Ray worker processes' ports per node
# Every process of a node inherits this from its `ray start` (raylet, workers, and what they start: engine
# processes, HAProxy). Ray puts each worker in its own process group, and HAProxy outlives its manager
# actor when that is SIGKILLed, so the `ray start` process group alone is not the whole node.
NODE_MARK_ENV = "SINKSERVE_CLUSTER_NODE"
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3"}


@dataclass(frozen=True)
class NodeSpec:
    """One node of the local cluster: its Ray resources and every port it binds."""

    name: str
    index: int  # 0 is the head
    num_cpus: float
    resources: tuple[tuple[str, float], ...]
    http_port: int

    @property
    def head(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class ClusterLayout:
    """The nodes and ports of a local cluster (module docstring: the table)."""

    port_base: int
    http_port: int
    nodes: tuple[NodeSpec, ...]

    @property
    def gcs_address(self) -> str:
        return f"{node_ip()}:{self.port_base}"

    @property
    def redis_port(self) -> int:
        return self.port_base + 60

    def port(self, node: NodeSpec, offset: int) -> int:
        """Ray's per-node ports: offsets 1..12 of the node's block of 20."""
        return self.port_base + 20 * node.index + offset

    def worker_ports(self, node: NodeSpec) -> tuple[int, int]:
        low = self.port_base + WORKER_PORTS * (node.index + 1)
        return low, low + WORKER_PORTS - 1

    def node(self, name: str) -> NodeSpec:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r}; nodes are {[n.name for n in self.nodes]}")

    @property
    def all_ports(self) -> list[int]:
        """Every TCP port the cluster binds (checked free before it starts)."""
        ports = [self.port_base, self.redis_port]
        for n in self.nodes:
            ports += [self.port(n, k) for k in range(1, 13)] + [n.http_port]
        return ports


# Below Linux's ephemeral range (32768-60999): there, a port free when checked can be taken a moment
# later as the local end of any outgoing connection (Ray makes many), and a raylet binding it crashed.
DEFAULT_PORT_BASE = 26000


def local_layout(port_base: int = DEFAULT_PORT_BASE, http_port: int = 8000, workers: int = 2,
                 head_cpus: float = 1.0, worker_cpus: float = 2.0) -> ClusterLayout:
    """Head plus ``workers`` worker nodes named ``worker-a``, ``worker-b``, ... (custom resources
    ``node_a``, ``node_b``, ... so a test can force and assert placement)."""
    if not 1 <= workers <= 4:
        raise ValueError(f"workers: 1 to 4, got {workers}")
    if port_base + 500 > 32768:
        logger.warning("port base %d reaches into the ephemeral port range (32768-): a node may fail to bind", port_base)
    nodes = [NodeSpec("head", 0, head_cpus, ((HEAD_RESOURCE, RESOURCE_UNITS),), http_port)]
    for i in range(workers):
        letter = "abcd"[i]
        nodes.append(NodeSpec(f"worker-{letter}", i + 1, worker_cpus,
                              ((POOL_RESOURCE, RESOURCE_UNITS), (f"node_{letter}", RESOURCE_UNITS)), http_port + i + 1))
    return ClusterLayout(port_base, http_port, tuple(nodes))


def cluster_config(cfg: dict[str, Any], redis_url: str) -> dict[str, Any]:
    """The Serve config ``cfg`` as it runs on the cluster (module docstring). Placement a config sets
    itself (``ingress.resources``, a pool's ``resources``) is kept."""
    out = copy.deepcopy(cfg)
    out["proxy_location"] = "EveryNode"
    out.setdefault("http_options", {})["host"] = "0.0.0.0"
    for app in out.get("applications", ()):
        if app.get("import_path", "app.builder:build_app") != "app.builder:build_app":
            continue
        args = app.setdefault("args", {})
        args["multi_node"] = True
        prefix = (args.get("store") or {}).get("prefix")
        args["store"] = {"kind": "redis", "url": redis_url, **({"prefix": prefix} if prefix else {})}
        ingress = args.setdefault("ingress", {})
        ingress.setdefault("resources", {HEAD_RESOURCE: 1.0})
        for pool in args.get("pools") or ():
            pool.setdefault("resources", {POOL_RESOURCE: 1.0})
            _session_kv_on_redis(pool, redis_url)
    return out


def _session_kv_on_redis(pool: dict[str, Any], redis_url: str) -> None:
    """A pool with session KV on and no backend chosen keeps it in the cluster's Redis (a directory is
    per node unless a shared mount; a config that names its backend is kept, given the URL if it lacks one)."""
    skv = (pool.get("engine") or {}).get("session_kv")
    if not isinstance(skv, dict) or not skv.get("enabled"):
        return
    skv.setdefault("backend", "redis")
    if skv["backend"] in ("redis", "tiered"):
        skv.setdefault("url", redis_url)


def node_ip() -> str:
    """The address Ray gives this machine's nodes (the host's own; Ray does not keep 127.0.0.1 for a head)."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def wait_port(port: int, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on {port}")
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:g}s")


@dataclass
class LocalCluster:
    """Start, inspect, break and stop a local cluster. Its state (pids, ports) is ``state_dir/state.json``,
    so ``sinkserve cluster down`` in another shell stops what ``up`` started."""

    layout: ClusterLayout
    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # extra environment of every node (API keys)
    pids: dict[str, int] = field(default_factory=dict)  # node name or "redis" -> process (group leader) id
    redis_url: str | None = None
    temp_dir: str | None = None

    # ---- state ------------------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.state_file.write_text(json.dumps({
            "port_base": self.layout.port_base, "http_port": self.layout.http_port,
            "workers": len(self.layout.nodes) - 1, "pids": self.pids, "redis_url": self.redis_url,
            "temp_dir": self.temp_dir}, indent=1))

    @classmethod
    def load(cls, state_dir: Path) -> "LocalCluster":
        st = json.loads((state_dir / "state.json").read_text())
        layout = local_layout(st["port_base"], st["http_port"], st["workers"])
        return cls(layout, state_dir, pids={k: int(v) for k, v in st["pids"].items()}, redis_url=st["redis_url"],
                   temp_dir=st["temp_dir"])

    # ---- start ------------------------------------------------------------------------------------

    @property
    def token_file(self) -> Path:
        return self.state_dir / "ray_auth_token"

    def ray_env(self) -> dict[str, str]:
        """What a process needs to join or reach this cluster: Ray 2.60 turns token authentication on
        for every ``ray start --head``; the cluster has its own token (never ~/.ray/auth_token, which
        other Ray clusters on the host may use)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file), "RAY_USAGE_STATS_ENABLED": "0"}

    def _write_token(self) -> None:
        import secrets

        if not self.token_file.exists():
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))

    def node_env(self, node: NodeSpec) -> dict[str, str]:
        """The environment of one node's ``ray start`` (its raylet and every worker it starts inherit it)."""
        from app.cli.serve import haproxy_env

        env = dict(os.environ)
        env.update(self.env)
        env.update(self.ray_env())
        env[NODE_MARK_ENV] = self.node_mark(node.name)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(haproxy_env(self.layout.port(node, 8), self.layout.port(node, 9)))
        if not node.head:
            env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(node.http_port)
        # No idle Python workers started ahead of need (num_cpus of them per node otherwise): memory.
        env["RAY_prestart_worker_first_driver"] = "0"
        # Ray's memory monitor kills workers when the *host* passes 95 % memory; on a shared dev machine
        # that is mostly other people's processes, and it killed this cluster's replicas (and its Serve
        # controller) in a loop. The kernel's OOM killer still guards the host.
        env.setdefault("RAY_memory_monitor_refresh_ms", "0")
        # A raylet must register with the GCS within this (60 s by default); on a loaded 2-core host a
        # worker node took longer and `ray start` gave up.
        env.setdefault("RAY_raylet_start_wait_time_s", "300")
        # Serve's fallback proxy (head only) has fixed ports too (8500/9500), shared with any other Serve
        # on the host: the cluster's own.
        env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] = str(self.layout.port(self.layout.nodes[0], 11))
        env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"] = str(self.layout.port(self.layout.nodes[0], 12))
        if node.head:
            # The GCS declares a node dead after this many failed health checks this far apart: 3 x 1 s
            # here (Ray's default, 5 x 3 s, held new requests to a lost node's replicas ~15 s longer).
            env.update(HEALTH_CHECK_ENV)
        return env

    def node_mark(self, name: str) -> str:
        """What every process of node ``name`` carries in its environment (``NODE_MARK_ENV``)."""
        return f"{self.state_dir.resolve()}#{name}"

    def node_command(self, node: NodeSpec) -> list[str]:
        lo, hi = self.layout.worker_ports(node)
        p = lambda k: str(self.layout.port(node, k))  # noqa: E731
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [ray if Path(ray).exists() else "ray", "start", "--block", "--disable-usage-stats",
               "--num-cpus", f"{node.num_cpus:g}", "--num-gpus", "0",
               "--resources", json.dumps(dict(node.resources)),
               "--node-manager-port", p(1), "--object-manager-port", p(2),
               "--dashboard-agent-listen-port", p(3), "--dashboard-agent-grpc-port", p(4),
               "--metrics-export-port", p(5), "--runtime-env-agent-port", p(6),
               "--min-worker-port", str(lo), "--max-worker-port", str(hi),
               "--object-store-memory", str(200 * 1024 * 1024), "--temp-dir", str(self.temp_dir)]
        if node.head:
            # The dashboard stays off, but Ray still starts its usage-stats module on --dashboard-port
            # (8265 by default, as every other Ray on the host): its own port.
            cmd += ["--head", "--port", str(self.layout.port_base), "--ray-client-server-port", p(7),
                    "--include-dashboard", "false", "--dashboard-port", p(10)]
        else:
            # One log monitor per host (Ray's advice for several nodes on one machine): the head's.
            cmd += ["--address", self.layout.gcs_address, "--include-log-monitor", "false"]
        return cmd

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.state_dir / f"{name}.log", "ab")
        # Its own session: the node is one process group, killed as one (kill_node, stop).
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(REPO_ROOT))
        log.close()
        self.pids[name] = proc.pid
        self.save()
        return proc

    def start_redis(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server): the cluster's store needs it")
        port = self.layout.redis_port
        data = self.state_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        # Append-only, fsynced every second: conversations and jobs outlive a restart of the store.
        proc = self._spawn("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data)],
                           dict(os.environ))
        wait_port(port, 15, "redis-server", proc)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.save()
        return self.redis_url

    def start(self, timeout_s: float = 180.0, redis_url: str | None = None) -> None:
        """Redis (unless ``redis_url`` names one), then the head, then the workers; returns once Ray
        reports every node alive."""
        busy = [p for p in self.layout.all_ports if not port_free(p)]
        if busy:
            raise RuntimeError(f"ports in use: {busy} (another cluster? pick --port-base / --port)")
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        import tempfile

        # Short: Ray's Unix socket paths live under it (108-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="ssc-")
        self.save()
        self._write_token()
        if redis_url is None:
            self.start_redis()
        else:
            self.redis_url = redis_url
        deadline = time.monotonic() + timeout_s
        head = self.layout.nodes[0]
        proc = self._spawn(head.name, self.node_command(head), self.node_env(head))
        wait_port(self.layout.port_base, timeout_s, "the Ray head (GCS)", proc)
        # Workers ask the GCS for the head node first and exit if it has not registered yet (seen on a
        # loaded host: the GCS listening, the head's raylet not yet in it).
        self.wait_nodes(1, max(5.0, deadline - time.monotonic()))
        # One at a time: nodes sharing a temp dir name their sockets and logs by the first free suffix
        # (raylet.1, plasma_store.1), and two workers starting together picked the same one -- the second
        # raylet then failed to bind its socket ("Address already in use") and crashed.
        for i, node in enumerate(self.layout.nodes[1:], start=2):
            self._spawn(node.name, self.node_command(node), self.node_env(node))
            self.wait_nodes(i, max(5.0, deadline - time.monotonic()))

    def alive_nodes(self) -> list[dict[str, Any]]:
        """Ray's alive nodes (a driver connects and leaves: a subprocess, so this process's Ray stays its own)."""
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print('SINKSERVE_JSON', json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} for n in ray.nodes() if n['Alive']]))"
                % self.layout.gcs_address)
        return self._driver(code)

    def where(self) -> dict[str, Any]:
        """Where everything runs, by node name: ``actors`` (class, name, node) and placement ``groups``
        (strategy, each bundle's node), for ``cluster status``, the tests and the node-loss drill."""
        code = f"""
import json, ray
from ray._private.state import state
ray.init(address={self.layout.gcs_address!r}, logging_level="ERROR", log_to_driver=False)
names = {{}}
for n in ray.nodes():
    if n["Alive"]:
        r = n["Resources"]
        names[n["NodeID"]] = "head" if {HEAD_RESOURCE!r} in r else next(
            ("worker-" + k[5:] for k in r if k.startswith("node_") and len(k) == 6), n["NodeID"][:12])
actors = [{{"class": a["ActorClassName"], "name": a.get("Name") or "", "node": names.get(a["Address"]["NodeID"], "?")}}
          for a in state.actor_table(None).values() if a["State"] == "ALIVE"]
groups = [{{"strategy": g["strategy"], "state": g["state"],
            "nodes": [names.get(n, "?") for n in g["bundles_to_node_id"].values()]}}
          for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
print("SINKSERVE_JSON", json.dumps({{"nodes": sorted(names.values()), "actors": actors, "groups": groups}}))
"""
        return self._driver(code)

    def _driver(self, code: str, timeout_s: float = 180.0) -> Any:
        """Run ``code`` as a short-lived Ray driver of this cluster; what it printed after ``SINKSERVE_JSON``. A
        subprocess, so the caller's own Ray (a test's, a benchmark's) is never touched."""
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                                 env={**os.environ, **self.ray_env()})
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"a driver of the cluster at {self.layout.gcs_address} did not finish in {timeout_s:g}s") from None
        if out.returncode != 0:
            raise RuntimeError(f"could not reach the cluster at {self.layout.gcs_address}: {out.stderr[-500:]}")
        # Ray may print its own lines on stdout too: the answer is the line with the marker.
        line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("SINKSERVE_JSON ")), None)
        if line is None:
            raise RuntimeError(f"a driver of the cluster at {self.layout.gcs_address} printed no answer: {out.stdout[-300:]}")
        return json.loads(line[len("SINKSERVE_JSON "):])

    def replica_nodes(self, deployment: str) -> list[str]:
        """The node of each live replica of ``deployment`` (e.g. ``pool-short-v1``), sorted."""
        return sorted(a["node"] for a in self.where()["actors"] if f"#{deployment}#" in a["name"])

    def raylet_crashed(self, name: str) -> bool:
        """Whether node ``name``'s raylet died under its ``ray start --block`` (a zombie child: seen under
        heavy load, a raylet failing a check while registering, and ``ray start`` staying up without it)."""
        parent = self.pids.get(name)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if comm == "raylet" and state == "Z" and int(ppid) == parent:
                return True
        return False

    def wait_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for name, pid in self.pids.items():
                if not pid_alive(pid):
                    raise RuntimeError(f"{name} exited during start-up: see {self.state_dir / (name + '.log')}")
                if name != "redis" and self.raylet_crashed(name):
                    # Seen under heavy load: the raylet failed a check while registering and `ray start
                    # --block` stayed up without it. Nothing would ever join; say so.
                    raise RuntimeError(f"the raylet of {name} exited during start-up: see "
                                       f"{self.temp_dir}/session_latest/logs/raylet*.out")
            try:
                seen = len(self.alive_nodes())
            except RuntimeError as e:  # a driver too slow on a loaded host: ask again until the deadline
                logger.info("waiting for the nodes: %s", e)
                continue
            if seen >= n:
                return
            time.sleep(1.0)
        raise RuntimeError(f"{seen} of {n} Ray nodes alive after {timeout_s:g}s (logs in {self.state_dir})")

    # ---- deploy -----------------------------------------------------------------------------------

    def deploy(self, cfg: dict[str, Any], timeout_s: float = 300.0) -> list[str]:
        """Deploy the Serve config ``cfg`` (already :func:`cluster_config`-ed) with the stock ``serve run
        --non-blocking`` (the Serve controller keeps it running after that command returns); returns
        the base URL of every node's proxy once each answers /readyz with 200."""
        import yaml

        path = self.state_dir / "effective-config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        serve_bin = Path(sys.executable).with_name("serve")
        cmd = [str(serve_bin) if serve_bin.exists() else "serve", "run", "--non-blocking",
               "--address", self.layout.gcs_address, str(path)]
        logger.info("running: %s", " ".join(cmd))
        env = {**os.environ, **self.env, **self.ray_env(),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        out = subprocess.run(cmd, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"serve run failed ({out.returncode}): {(out.stdout + out.stderr)[-2000:]}")
        urls = self.proxy_urls()
        self.wait_ready(urls, timeout_s)
        return urls

    def proxy_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{n.http_port}" for n in self.layout.nodes if n.name in self.pids]

    def wait_ready(self, urls: list[str], timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        last: dict[str, str] = {}
        while pending and time.monotonic() < deadline:
            for url in list(pending):
                try:
                    r = httpx.get(url + "/readyz", timeout=5)
                    if r.status_code == 200:
                        pending.remove(url)
                    last[url] = f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    last[url] = type(e).__name__
            time.sleep(1.0)
        if pending:
            raise RuntimeError("not ready: " + "; ".join(f"{u}: {last.get(u)}" for u in pending))

    # ---- break and stop ---------------------------------------------------------------------------

    def kill_node(self, name: str) -> None:
        """SIGKILL one node's whole process group (``ray start``, raylet, agents, workers): the node is lost."""
        if self.layout.node(name).head:
            raise ValueError("the head holds the GCS and the Serve controller: kill a worker node")
        pid = self.pids.pop(name)
        kill_group(pid, signal.SIGKILL)
        kill_marked(self.node_mark(name), signal.SIGKILL)
        self.save()

    def stop(self, keep_logs: bool = False) -> None:
        """End every process group this cluster started: workers, head, then Redis; the Ray temp dir
        (its logs) goes too unless ``keep_logs`` (a failed start: the logs say why)."""
        order = [n.name for n in reversed(self.layout.nodes)] + ["redis"]
        for name in order:
            pid = self.pids.get(name)
            if pid is None:
                continue
            kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for name in order:
            pid = self.pids.get(name)
            while pid is not None and group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid is not None and group_alive(pid):
                kill_group(pid, signal.SIGKILL)
            self.pids.pop(name, None)
        for node in self.layout.nodes:  # what outlived its group (HAProxy, an engine process)
            kill_marked(self.node_mark(node.name), signal.SIGKILL)
        self.save()
        if self.temp_dir and Path(self.temp_dir).name.startswith("ssc-") and not keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our child that exited
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    pid_alive(pgid)  # reaps the leader if it is our child
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment has ``NODE_MARK_ENV=mark`` (this user's; others' are unreadable)."""
    want = f"{NODE_MARK_ENV}={mark}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:
            continue
    return out


def kill_marked(mark: str, sig: int) -> None:
    for pid in marked_pids(mark):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
