"""One Serve application per test session (Ray with num_cpus=2), real HTTP on 127.0.0.1.

Topology under test: HAProxy, ingress x1, hub, pools ``short`` (v1 + a weight-0 canary v2, TP=1, no
eviction) and ``long`` (v1 only, TP set by SINKSERVE_TEST_LONG_TP, default 2; sinks + a 64-token
sliding window, so long prompts evict) on a tiny random Llama.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
LIMITED_KEY = "test-key-limited"  # used only by the rate-limit test
# Keys of the conversation app's tenants (tests/serve/test_conversations.py); the shared app accepts
# them too, with no quota (it configures no tenants).
ACME_KEY, FREE_KEY = "test-key-acme", "test-key-free"
SHORT_MAX, LONG_MAX = 48, 400
ENGINE = {"num_kv_blocks": 96, "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256}
LONG_DEFAULT_MAX_TOKENS = 40  # the long pool evicts: without a cap a chat's default would be max_stream_tokens
LONG_POLICY = {"eviction_policy": "sliding_window", "window": 64, "protected_positions": [0, 1, 2, 3]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prebuild_deepspeed_shm_op() -> None:
    """DeepSpeed JIT-compiles its CPU shared-memory all-reduce on first use (minutes on 2 CPUs).
    Build it once here, in one process, so the TP workers find it cached instead of both ranks
    compiling inside the deployment's start-up window."""
    import glob
    import subprocess
    import sys

    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
    if glob.glob(os.path.join(ext_dir, "*", "deepspeed_shm_comm", "deepspeed_shm_comm*.so")):
        return
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True, timeout=900)



def wait_ready(base: str, timeout_s: float, what: str, poll_s: float = 0.5, request_timeout_s: float = 10) -> None:
    """Poll ``base``/readyz until it answers 200; ``RuntimeError`` naming ``what`` and the last answer."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        r = httpx.get(base + "/readyz", timeout=request_timeout_s)
        if r.status_code == 200:
            return
        time.sleep(poll_s)
    raise RuntimeError(f"{what} not ready: {r.text}")

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from engine.worker.weights import write_manifest
    from tests.serve.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    write_manifest(model)  # so pools verify it at load and report its fingerprint
    return str(model)


def app_args(model: str, long_tp: int) -> dict:
    return {
        "model": model,
        "served_model_name": "tiny",
        "ingress": {"num_replicas": 1, "num_cpus": 0.05, "rate_limit_rps": 10.0, "rate_limit_burst": 60,  # the suite's own traffic stays well under it
                    "max_passages": 16},
        "versions": [{"name": "v1", "weight": 1.0}, {"name": "v2", "weight": 0.0}],
        "pools": [
            {"name": "short", "max_prompt_tokens": SHORT_MAX, "timeout_s": 60, "num_cpus": 0.05,
             "engine": {**ENGINE, "cache_policy": {"eviction_policy": "none"}}},
            {"name": "long", "max_prompt_tokens": LONG_MAX, "timeout_s": 120, "num_cpus": 0.05,
             "versions": ["v1"], "worker_num_cpus": 0.05, "default_max_tokens": LONG_DEFAULT_MAX_TOKENS,
             "engine": {**ENGINE, "tensor_parallel_size": long_tp, "cache_policy": LONG_POLICY}},
        ],
        "stats_push_interval_s": 0.25,
    }


@pytest.fixture(scope="session")
def server(tiny_model):
    """Start Ray + Serve, deploy, record /readyz while models load, yield the base URL."""
    import ray
    from ray import serve

    from app.builder import build_app
    from app.cli.serve import haproxy_env

    os.environ["SINKSERVE_API_KEYS"] = f"{API_KEY},{LIMITED_KEY},{ACME_KEY}:acme,{FREE_KEY}:free"
    # Operator keys (app/http/auth.py): the suite forces pools, pins the weight-0 version and reads
    # /metrics/tenants with these; ACME_KEY and LIMITED_KEY are plain tenant keys.
    os.environ["SINKSERVE_OPERATOR_KEYS"] = f"{API_KEY},{FREE_KEY}:free"
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    # The HTTP entry `sinkserve serve` uses (HAProxy in front of the ingress replicas); read when Ray
    # starts. HAProxy's side listeners get ports of their own, so the suite runs beside `make run`.
    os.environ.update(haproxy_env(stats_port=_free_port(), metrics_port=_free_port()))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=bool(os.environ.get("SINKSERVE_TEST_LOGS")))
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    long_tp = int(os.environ.get("SINKSERVE_TEST_LONG_TP", "2"))
    if long_tp > 1:
        prebuild_deepspeed_shm_op()
    app = build_app(app_args(tiny_model, long_tp))

    import threading

    readyz_seen: list[int] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                readyz_seen.append(httpx.get(base + "/readyz", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    t0 = time.time()
    serve.run(app, name="sinkserve", route_prefix="/")
    wait_ready(base, 120, "the app, after deploy,", poll_s=0.25, request_timeout_s=5)
    stop.set()
    t.join()
    info = {"base": base, "readyz_seen": readyz_seen, "startup_s": time.time() - t0, "long_tp": long_tp,
            "args": app_args(tiny_model, long_tp)}
    yield info
    serve.shutdown()
    ray.shutdown()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c
