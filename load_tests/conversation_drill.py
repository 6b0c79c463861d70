"""Drill: conversations under Locust (prefix-cache hit rate per turn), then a job across an app restart.

Starts its own Ray (2 CPUs) and Serve app in process: the reference model, two ingress replicas, one
pool ``chat`` with two replicas (sinks + 512-token window, so a job may stream long), the SQLite store
in a fresh directory. Then ``locust -f load_tests/conversations.py`` for ``SECONDS`` with ``USERS``
users (CSV: /tmp/i26-locust_stats.csv; USERS=0 skips it), then a 12,000-token job is submitted,
``serve.shutdown()`` while it runs, the app started again on the same store, and the job followed to
its end. Prints each step. Hold the Ray lock (docs: COMMON rules of the shared machine)::

    flock /tmp/sinkserve-ray.lock .venv/bin/python -m load_tests.conversation_drill 8 60s
"""
import json, os, socket, subprocess, sys, time, tempfile
from pathlib import Path
import httpx

REPO = Path(__file__).resolve().parents[1]
KEY = "drill-key"
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

def args(data_dir):
    return {
        "model": str(REPO / "assets/reference-model"), "served_model_name": "ref",
        "ingress": {"num_replicas": 2, "num_cpus": 0.05},
        "pools": [{"name": "chat", "max_prompt_tokens": 1000, "timeout_s": 120, "num_cpus": 0.05, "num_replicas": 2,
                   "engine": {"max_model_len": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 256, "cache_policy": {"eviction_policy": "sliding_window", "window": 512, "protected_positions": [0, 1, 2, 3]}}}],
        "store": {"kind": "sqlite", "data_dir": data_dir},
        "jobs": {"pool": "chat", "max_share": 0.25},
    }

def wait_ready(base):
    for _ in range(400):
        try:
            if httpx.get(base + "/readyz", timeout=5).status_code == 200: return
        except httpx.HTTPError: pass
        time.sleep(0.5)
    raise RuntimeError("not ready")

def main():
    import ray
    from ray import serve
    from app.builder import build_app
    from app.cli.serve import haproxy_env
    os.environ["SINKSERVE_API_KEYS"] = KEY
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    os.environ.update(haproxy_env(stats_port=free_port(), metrics_port=free_port()))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    data = tempfile.mkdtemp(prefix="i26-drill-")
    t = time.time(); serve.run(build_app(args(data)), name="drill", route_prefix="/"); wait_ready(base)
    print("app up in %.0fs" % (time.time() - t), flush=True)
    users, secs = sys.argv[1], sys.argv[2]
    out = subprocess.CompletedProcess([], 0, "", "") if users == "0" else subprocess.run([sys.executable, "-m", "locust", "-f", str(REPO / "load_tests/conversations.py"), "--headless",
                          "-u", users, "-r", "4", "-t", secs, "--host", base, "--csv", "/tmp/i26-locust", "--only-summary"],
                         env={**os.environ, "SINKSERVE_API_KEY": KEY}, capture_output=True, text=True, cwd=REPO)
    print(out.stdout[-6000:], out.stderr[-6000:], flush=True)
    h = {"Authorization": f"Bearer {KEY}"}
    job = httpx.post(base + "/v1/jobs", headers=h, json={"endpoint": "/v1/completions", "body": {
        "prompt": "def f(x):", "max_tokens": 12000, "temperature": 0, "sinkserve": {"ignore_eos": True}}}).json()
    print("submitted", job, flush=True)
    for _ in range(100):
        v = httpx.get(base + f"/v1/jobs/{job['id']}", headers=h).json()
        if v["status"] == "running": break
        time.sleep(0.1)
    print("before restart", v, flush=True)
    t = time.time(); serve.shutdown(); print("serve shutdown in %.0fs" % (time.time() - t), flush=True)
    time.sleep(10)  # the controller finishes dying
    t = time.time()
    for attempt in range(3):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(args(data)), name="drill", route_prefix="/"); break
        except Exception as e:
            print("restart attempt failed:", type(e).__name__, flush=True); time.sleep(10)
    wait_ready(base)
    print("app up again in %.0fs" % (time.time() - t), flush=True)
    for _ in range(600):
        v = httpx.get(base + f"/v1/jobs/{job['id']}", headers=h).json()
        if v["status"] in ("succeeded", "failed"): break
        time.sleep(0.5)
    print("after restart", json.dumps({k: v[k] for k in v if k != "result"}), "tokens",
          (v.get("result") or {}).get("usage"), flush=True)
    serve.shutdown(); ray.shutdown()

if __name__ == "__main__":
    main()
