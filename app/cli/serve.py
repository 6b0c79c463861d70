"""``sinkserve serve CONFIG``: start the Serve application from a Serve config file.

One command still gives a secured server: when no key source is set (``SINKSERVE_API_KEYS`` /
``SINKSERVE_API_KEYS_FILE``) and the config does not say ``auth: disabled``, a key file is created
(``~/.sinkserve/api_keys``, mode 0600) on first use and its key printed. Then this runs the stock
``serve run`` on the (possibly overridden) config, so ``serve run CONFIG`` and this command deploy
exactly the same thing.

The HTTP entry is HAProxy: Serve's HAProxy mode puts the HAProxy binary that ``ray[serve]`` bundles
in front of the ingress replicas, which serve HTTP themselves, so no Python proxy sits on the request
path (measured in docs/serving_benchmark.md). The mode is read from
``RAY_SERVE_ENABLE_HA_PROXY`` when Ray starts, so it applies to the cluster ``serve run`` starts
itself; a cluster started earlier with ``ray start`` needs that variable in its own environment.

Every application's ``args`` are validated (``AppArgs``, each pool's ``engine:`` block by the
engine's own config classes) before anything starts: a misspelled key exits 2 naming its path.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import yaml

from pydantic import ValidationError

from app.http.auth import DEFAULT_KEY_FILE, KEYS_ENV, KEYS_FILE_ENV, ensure_key_file
from app.settings import REPO_ROOT, AppArgs, check_limits
from engine.errors import ConfigError, ModelLoadError
from engine.worker.model_store import normalize_spec

logger = logging.getLogger("sinkserve.cli")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the Ray Serve application from a Serve config file")
    p.add_argument("config", nargs="?", default="serve_configs/prod.yaml", help="Serve config YAML")
    p.add_argument("--model", help="model for every application (overrides args.model): a name from the model cache "
                   "(reference, smollm2-135m-instruct), a Hugging Face directory, a .gguf file or a directory holding one")
    p.add_argument("--host", help="HTTP host (overrides http_options.host)")
    p.add_argument("--port", type=int, help="HTTP port (overrides http_options.port)")
    p.add_argument("--key-file", type=Path, default=DEFAULT_KEY_FILE, help="API key file to create/use")
    p.add_argument("--haproxy-stats-port", type=int, help="HAProxy's stats page port (default 8404)")
    p.add_argument("--haproxy-metrics-port", type=int, help="HAProxy's Prometheus listener port (default 9101)")
    p.add_argument("--dry-run", action="store_true", help="print the effective config and exit")
    p.set_defaults(run=run)


def effective_config(path: Path, model: str | None, host: str | None, port: int | None) -> dict:
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict) or not cfg.get("applications"):
        raise SystemExit(f"{path}: not a Serve config (no 'applications:' list)")
    http = cfg.setdefault("http_options", {})
    if host:
        http["host"] = host
    if port:
        http["port"] = port
    for app in cfg["applications"]:
        if model:
            app.setdefault("args", {})["model"] = normalize_spec(model)  # `serve run` starts in the project root
    return cfg


HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


STATS_PORT_ENV = "RAY_SERVE_HAPROXY_STATS_PORT"  # HAProxy's stats page (Ray's default 8404)
METRICS_PORT_ENV = "RAY_SERVE_HAPROXY_METRICS_PORT"  # HAProxy's Prometheus listener (Ray's default 9101)


def haproxy_env(stats_port: int | None = None, metrics_port: int | None = None) -> dict[str, str]:
    """Environment that makes HAProxy the HTTP entry of the Ray cluster ``serve run`` starts.

    HAProxy also opens a stats page and a Prometheus listener on fixed ports (8404, 9101 unless set
    here). Two Serve apps on one machine (``make run`` beside ``make test``) must give them different
    ports, or the second HAProxy fails with "Address already in use". Ray 2.60's HAProxy template
    binds both on every interface (not the HTTP host): keep them behind the host's firewall
    (docs/operations.md).
    """
    # The HAProxy manager actor takes longer to report ready than Serve's 5 s readiness check allows
    # when the CPUs are busy (seen here with training on both cores: killed after three checks and
    # `serve.start` failed); 30 s lets a loaded node start it.
    env = {HAPROXY_ENV: "1", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
    if stats_port is not None:
        env[STATS_PORT_ENV] = str(stats_port)
    if metrics_port is not None:
        env[METRICS_PORT_ENV] = str(metrics_port)
    return env


def validate_apps(cfg: dict) -> str | None:
    """The first application whose ``args`` do not validate, as one message naming the field."""
    for app in cfg["applications"]:
        if app.get("import_path", "app.builder:build_app") != "app.builder:build_app":
            continue
        try:
            check_limits(AppArgs.model_validate(app.get("args") or {}))  # token counts against the model
        except ValidationError as e:
            lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors(include_url=False)]
            return f"application {app.get('name', '?')!r}: invalid args\n" + "\n".join(lines)
        except ConfigError as e:
            return f"application {app.get('name', '?')!r}: {e}"
    return None


def resolve_models(cfg: dict) -> None:
    """Replace every application's model spec (``args.model``, ``versions[].model``) by the directory
    it resolves to (``engine/worker/model_store.py``), in this process: a GGUF is converted and a catalog
    name fetched here, with their progress on this terminal, and a model that cannot be had stops the
    command with one line (``ModelLoadError``) instead of a failed deployment. The deployed config
    then names directories, so the builder and the replicas only load."""
    from engine.worker.model_store import DEFAULT_MODEL, describe, resolve_model

    for app in cfg["applications"]:
        if app.get("import_path", "app.builder:build_app") != "app.builder:build_app":
            continue
        args = app.setdefault("args", {})
        args["model"] = resolve_model(args.get("model") or DEFAULT_MODEL)
        logger.info("model: %s", describe(args["model"]))
        for v in args.get("versions") or []:
            if v.get("model"):
                v["model"] = resolve_model(v["model"])


def masked_store_urls(cfg: dict) -> dict:
    """A copy of ``cfg`` whose store URLs show no password (for printing).

    >>> masked_store_urls({"applications": [{"args": {"store": {"kind": "redis", "url": "redis://:pw@h:6379/0"}}}]})
    {'applications': [{'args': {'store': {'kind': 'redis', 'url': 'redis://***@h:6379/0'}}}]}
    """
    import copy

    from engine.memory.urls import mask_url

    out = copy.deepcopy(cfg)
    for app in out.get("applications", ()):
        store = (app.get("args") or {}).get("store") or {}
        if store.get("url"):
            store["url"] = mask_url(store["url"])
    return out


def needs_keys(cfg: dict) -> bool:
    return any((a.get("args") or {}).get("auth", "enabled") != "disabled" for a in cfg["applications"])


def run(args: argparse.Namespace) -> int:
    path = Path(args.config)
    if not path.is_file():
        print(f"sinkserve serve: no such config file: {path}", file=sys.stderr)
        return 2
    cfg = effective_config(path, args.model, args.host, args.port)
    problem = validate_apps(cfg)
    if problem is not None:
        print(f"sinkserve serve: {path}: {problem}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if needs_keys(cfg) and not (env.get(KEYS_ENV) or env.get(KEYS_FILE_ENV)):
        key, created = ensure_key_file(args.key_file)
        env[KEYS_FILE_ENV] = str(args.key_file)
        # The key itself is never printed (terminals and CI logs keep what they show): where it is, and
        # a command that reads it.
        print(f"{'Created' if created else 'Using'} API key file {args.key_file}")
        print(f"  KEY=$(head -1 {args.key_file})")
        print(f'  curl -H "Authorization: Bearer $KEY" http://{cfg["http_options"].get("host", "127.0.0.1")}:'
              f'{cfg["http_options"].get("port", 8000)}/v1/models')
    # Workers must import app/ and engine/ whatever their working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(haproxy_env(args.haproxy_stats_port, args.haproxy_metrics_port))
    print(f"HTTP entry: haproxy ({HAPROXY_ENV}={env[HAPROXY_ENV]})")
    if args.dry_run:
        print(yaml.safe_dump(masked_store_urls(cfg), sort_keys=False))
        return 0
    try:
        resolve_models(cfg)
    except ModelLoadError as e:
        print(f"sinkserve serve: {e}", file=sys.stderr)
        return 2
    problem = validate_apps(cfg)  # again, against the models now resolved (a fetched or fallen-back one)
    if problem is not None:
        print(f"sinkserve serve: {path}: {problem}", file=sys.stderr)
        return 2
    # The effective config is kept (not a temp file) so an operator can see what was deployed.
    out = args.key_file.parent / "effective-config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    serve_bin = Path(sys.executable).with_name("serve")
    cmd = [str(serve_bin) if serve_bin.exists() else "serve", "run", str(out)]
    logger.info("running: %s", " ".join(cmd))
    sys.stdout.flush()
    os.chdir(REPO_ROOT)
    # exec, not a child process: Ctrl-C / SIGTERM reach `serve run` directly, which drains and stops.
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
