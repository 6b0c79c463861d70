"""Chaos over HTTP against the whole application (HAProxy, ingress, hub, pools short and long, each an
engine process), with the fault injector loaded in every process (``inject/sitecustomize.py``).

Slow to start (a local Ray and three engines), so it runs in ``make chaos`` (SINKSERVE_CHAOS_FULL=1),
which writes the recorded figures to docs/chaos.md. Each case states what must happen and checks it:

- a 20 MB body while /healthz is polled: 413 naming the limit; every probe answered 200;
- a poison request beside healthy ones: the poison gets a 500 naming it, the healthy 0 errors, the
  engine process keeps running (same pid);
- an engine that hangs: the watchdog kills it (503 "engine hung"), the replica starts a new one, counted
  in sinkserve_engine_watchdog_restarts_total; requests succeed again;
- the short pool's engine process killed under load: requests sent during its restart that fit the long
  pool succeed (>= 99 %), counted in sinkserve_failover_total.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.chaos.conftest import inject_env, record

pytestmark = pytest.mark.skipif(os.environ.get("SINKSERVE_CHAOS_FULL") != "1",
                                reason="starts a local Ray and three engines: run with `make chaos`")

KEY = "chaos-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WATCHDOG_S = 3.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    import ray
    from ray import serve

    from bench.local_app import start_local_app
    from engine.worker.weights import write_manifest
    from tests.serve.conftest import app_args
    from tests.serve.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    write_manifest(model)
    os.environ.update(inject_env())  # before Ray starts: every worker and engine child inherits it
    args = app_args(str(model), 1)  # long pool at TP = 1: no DeepSpeed build
    args["ingress"].pop("rate_limit_rps")  # the load below is the point, not the rate limit
    args["versions"] = [{"name": "v1", "weight": 1.0}]
    for p in args["pools"]:
        p["engine_watchdog_s"] = WATCHDOG_S
    url = start_local_app(args, KEY, ready_timeout_s=240.0)
    yield url
    serve.shutdown()
    ray.shutdown()


def pool_info(deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name="sinkserve").info.remote().result(timeout_s=30)


def completion(c: httpx.Client, prompt: str = "hello chaos", **kw) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                           "sinkserve": {"ignore_eos": True}, **kw})


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_20_mb_body_is_refused_while_healthz_keeps_answering(base: str) -> None:
    probes: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base, timeout=10) as c:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    probes.append((c.get("/healthz").status_code, time.perf_counter() - t))
                except httpx.HTTPError:
                    probes.append((0, time.perf_counter() - t))
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    body = b'{"prompt": "' + b"a" * (20 * 1024 * 1024) + b'", "max_tokens": 1}'
    try:
        with httpx.Client(base_url=base, headers=AUTH, timeout=120) as c:
            time.sleep(0.5)
            t = time.perf_counter()
            sized = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            sized_s = time.perf_counter() - t

            def chunks():
                for i in range(0, len(body), 1 << 20):
                    yield body[i : i + (1 << 20)]

            t = time.perf_counter()
            chunked = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            chunked_s = time.perf_counter() - t
            time.sleep(0.5)
    finally:
        stop.set()
        poller.join()
    for r in (sized, chunked):
        assert r.status_code == 413, r.text[:300]
        err = r.json()["error"]
        assert "max_body_bytes" in err["message"] and str(8 * 1024 * 1024) in err["message"]
    assert probes and all(code == 200 for code, _ in probes), [p for p in probes if p[0] != 200][:5]
    lat = sorted(s for _, s in probes)
    record("body_20mb", refused_sized_s=round(sized_s, 2), refused_chunked_s=round(chunked_s, 2), healthz_probes=len(lat),
           healthz_median_ms=round(1000 * statistics.median(lat), 1), healthz_max_ms=round(1000 * lat[-1], 1))


def test_a_poison_request_beside_healthy_ones_fails_alone(base: str) -> None:
    pid = pool_info("pool-short-v1")["engine_pid"]
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c, ThreadPoolExecutor(12) as ex:
        jobs = [ex.submit(completion, c) for _ in range(20)]
        poison = [ex.submit(completion, c, stop=["CHAOS-POISON"]) for _ in range(3)]
        healthy = [j.result() for j in jobs]
        bad = [j.result() for j in poison]
    assert [r.status_code for r in healthy] == [200] * 20
    for r in bad:
        assert r.status_code == 500
        msg = r.json()["error"]["message"]
        assert re.search(r"request cmpl-\S+ failed in the engine: detokenization failed: RuntimeError", msg), msg
    assert pool_info("pool-short-v1")["engine_pid"] == pid  # 0 restarts
    record("poison", healthy_ok=sum(r.status_code == 200 for r in healthy), healthy_total=len(healthy),
           poison_500=sum(r.status_code == 500 for r in bad), engine_restarts=0)


def wait_for_new_engine(deployment: str, old_pid: int, timeout_s: float = 120.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if pool_info(deployment)["engine_pid"] != old_pid:
                return time.monotonic()
        except Exception:  # noqa: BLE001 - the replica may be restarting
            pass
        time.sleep(0.2)
    raise AssertionError(f"{deployment}: no new engine within {timeout_s:g}s")


def test_a_hung_engine_is_killed_restarted_and_counted(base: str) -> None:
    pid = pool_info("pool-short-v1")["engine_pid"]
    with httpx.Client(base_url=base, headers=AUTH, timeout=120) as c:
        before = metric(c.get("/metrics").text, "sinkserve_engine_watchdog_restarts_total", pool="short")
        t = time.monotonic()
        r = completion(c, stop=["CHAOS-HANG"])
        answered_s = time.monotonic() - t
        assert r.status_code == 503 and "engine hung" in r.json()["error"]["message"], r.text[:300]
        back = wait_for_new_engine("pool-short-v1", pid)
        restart_s = back - t
        ok = completion(c)
        assert ok.status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the count arrives with the pool's next stats push
            after = metric(c.get("/metrics").text, "sinkserve_engine_watchdog_restarts_total", pool="short")
            if after > before:
                break
            time.sleep(0.5)
    assert after == before + 1
    record("hang", watchdog_s=WATCHDOG_S, answered_503_after_s=round(answered_s, 2), new_engine_after_s=round(restart_s, 2))


def test_killing_the_short_pools_engine_under_load_fails_over_to_long(base: str) -> None:
    results: list[tuple[float, float, int, str]] = []  # sent, ended, status, pool
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=base, headers=AUTH, timeout=60) as c:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    r = completion(c)
                    results.append((t, time.monotonic(), r.status_code, r.headers.get("x-sinkserve-pool", "")))
                except httpx.HTTPError:
                    results.append((t, time.monotonic(), 0, ""))

    with httpx.Client(base_url=base, timeout=30) as m:
        before = metric(m.get("/metrics").text, "sinkserve_failover_total", from_pool="short", to_pool="long")
    threads = [threading.Thread(target=client) for _ in range(4)]
    for th in threads:
        th.start()
    try:
        time.sleep(3.0)
        pid = pool_info("pool-short-v1")["engine_pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        back = wait_for_new_engine("pool-short-v1", pid)
        time.sleep(2.0)
    finally:
        stop.set()
        for th in threads:
            th.join()
    with httpx.Client(base_url=base, timeout=30) as m:
        after = metric(m.get("/metrics").text, "sinkserve_failover_total", from_pool="short", to_pool="long")
    during = [r for r in results if killed <= r[0] <= back]
    in_flight = [r for r in results if r[0] < killed < r[1]]
    ok = sum(r[2] == 200 for r in during)
    rate = ok / len(during)
    record("kill_short_engine", restart_s=round(back - killed, 2), requests_during=len(during), ok_during=ok,
           success_rate_during=round(rate, 4), served_by_long_during=sum(r[3] == "long" for r in during),
           in_flight_at_kill=len(in_flight), in_flight_failed=sum(r[2] != 200 for r in in_flight),
           failovers=after - before)
    assert len(during) >= 20
    assert rate >= 0.99, [r for r in during if r[2] != 200][:5]
    assert after > before
