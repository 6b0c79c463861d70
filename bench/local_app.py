"""Start the Serve application in this process for a benchmark: a local Ray, HAProxy in front with
side listeners on free ports (so it runs beside `make run`), the given app args, and wait for /readyz."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_app(args: dict[str, Any], key: str, ready_timeout_s: float = 120.0) -> str:
    """Deploy ``build_app(args)`` (API key ``key``) on a new local Ray; returns the base URL once ready."""
    import httpx
    import ray
    from ray import serve

    from app.builder import build_app
    from app.cli.serve import haproxy_env

    os.environ["SINKSERVE_API_KEYS"] = key
    # The same environment `sinkserve serve` sets; Serve reads it when Ray starts, so before ray.init.
    os.environ.update(haproxy_env(free_port(), free_port()))
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
    serve.run(build_app(args), name="sinkserve", route_prefix="/", logging_config={"enable_access_log": False})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + ready_timeout_s
    while time.time() < deadline:
        if httpx.get(base + "/readyz").status_code == 200:
            return base
        time.sleep(0.25)
    raise RuntimeError(f"the application did not become ready within {ready_timeout_s:g}s")
