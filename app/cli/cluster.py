"""``sinkserve cluster up|down|status``: a three-node Ray cluster on this machine serving a Serve config
(``app/cli/local_cluster.py``; ``make cluster`` / ``make cluster-down``; docs/cluster.md).

``up`` starts ``redis-server``, a Ray head and two worker nodes (each its own ``ray start --block``
process group, with the cluster's own temp dir, ports and auth token), validates the config as
``sinkserve serve`` does, rewrites it for the cluster (Redis store, ``multi_node: true``, placement
resources, HTTP on every interface) and deploys it; it returns once every node's proxy answers
/readyz, leaving the cluster running. ``down`` stops exactly what ``up`` started (its state dir).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.http.auth import DEFAULT_KEY_FILE, KEYS_ENV, KEYS_FILE_ENV, ensure_key_file

DEFAULT_STATE_DIR = Path("~/.sinkserve/cluster").expanduser()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cluster", help="a local multi-node Ray cluster (head + 2 workers + Redis) serving a config")
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the cluster and deploy CONFIG across it")
    up.add_argument("config", nargs="?", default="serve_configs/prod.yaml", help="Serve config YAML")
    up.add_argument("--model", help="model for every application (as `sinkserve serve --model`)")
    up.add_argument("--port", type=int, help="the head's HTTP port (default: the config's); workers take the next ones")
    up.add_argument("--port-base", type=int, default=26000,
                    help="first of the 400 ports Ray and Redis use (default 26000; keep it below 32768, the ephemeral range)")
    up.add_argument("--redis-url", help="use this Redis instead of starting one (a real cluster's shared store)")
    up.add_argument("--key-file", type=Path, default=DEFAULT_KEY_FILE, help="API key file to create/use")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the nodes and the application")
    for q in (up, sub.add_parser("down", help="stop what `cluster up` started"),
              sub.add_parser("status", help="the cluster's nodes and proxies")):
        q.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="pids, logs, Redis data, token")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from app.cli.local_cluster import LocalCluster

    state = args.state_dir.expanduser()
    if args.action == "down":
        if not (state / "state.json").exists():
            print(f"sinkserve cluster: no cluster state in {state}", file=sys.stderr)
            return 1
        LocalCluster.load(state).stop()
        print(f"stopped the cluster of {state}")
        return 0
    if args.action == "status":
        if not (state / "state.json").exists():
            print(f"sinkserve cluster: no cluster state in {state}", file=sys.stderr)
            return 1
        c = LocalCluster.load(state)
        print(f"processes: {c.pids}\nredis: {c.redis_url}\nproxies: {' '.join(c.proxy_urls())}")
        where = c.where()
        for node in where["nodes"]:
            here = sorted(a["name"].split("#")[1] if "#" in a["name"] else a["class"]
                          for a in where["actors"] if a["node"] == node)
            print(f"  {node}: {', '.join(here)}")
        return 0
    return up(args, state)


def up(args: argparse.Namespace, state: Path) -> int:
    from app.cli.serve import effective_config, needs_keys, resolve_models, validate_apps
    from app.cli.local_cluster import LocalCluster, cluster_config, local_layout
    from engine.errors import ModelLoadError

    path = Path(args.config)
    if not path.is_file():
        print(f"sinkserve cluster: no such config file: {path}", file=sys.stderr)
        return 2
    if (state / "state.json").exists() and LocalCluster.load(state).pids:
        print(f"sinkserve cluster: a cluster from {state} is still running: `sinkserve cluster down` first",
              file=sys.stderr)
        return 2
    cfg = effective_config(path, args.model, None, args.port)
    http_port = int(cfg.get("http_options", {}).get("port", 8000))
    layout = local_layout(args.port_base, http_port)
    # Validated as it will run (Redis, multi_node) before anything starts; the URL is a placeholder here.
    problem = validate_apps(cluster_config(cfg, args.redis_url or f"redis://127.0.0.1:{layout.redis_port}/0"))
    if problem is not None:
        print(f"sinkserve cluster: {path}: {problem}", file=sys.stderr)
        return 2
    try:
        resolve_models(cfg)
    except ModelLoadError as e:
        print(f"sinkserve cluster: {e}", file=sys.stderr)
        return 2
    env: dict[str, str] = {}
    if needs_keys(cfg) and not (os.environ.get(KEYS_ENV) or os.environ.get(KEYS_FILE_ENV)):
        _, created = ensure_key_file(args.key_file)
        env[KEYS_FILE_ENV] = str(args.key_file.expanduser().resolve())
        print(f"{'Created' if created else 'Using'} API key file {args.key_file}  (KEY=$(head -1 {args.key_file}))")
    cluster = LocalCluster(layout, state, env=env)
    try:
        try:
            cluster.start(timeout_s=args.timeout, redis_url=args.redis_url)
        except RuntimeError as e:
            # Once more from nothing: a raylet can fail to register on a host too loaded to answer in time.
            print(f"sinkserve cluster: start failed ({e}); stopping it and starting once more", file=sys.stderr)
            cluster.stop(keep_logs=True)
            cluster = LocalCluster(layout, state, env=env)
            cluster.start(timeout_s=args.timeout, redis_url=args.redis_url)
        print(f"nodes up: {', '.join(n.name for n in layout.nodes)}; store {cluster.redis_url}")
        urls = cluster.deploy(cluster_config(cfg, cluster.redis_url), timeout_s=args.timeout)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - whatever stopped it, nothing it started stays up
        print(f"sinkserve cluster: {type(e).__name__}: {e}\n(logs in {state} and {cluster.temp_dir}; stopping what "
              "started)", file=sys.stderr)
        cluster.stop(keep_logs=True)
        return 1
    print("ready; each node's proxy: " + " ".join(urls))
    print("stop with: sinkserve cluster down" + (f" --state-dir {state}" if state != DEFAULT_STATE_DIR else ""))
    return 0
