"""Drill: a worker node of the local 3-node cluster lost under load (issue 40 item 2).

Starts the cluster with ``sinkserve cluster up`` (prod.yaml, the reference model; its own state dir
and ports), then:

1. optional Locust run across the three proxies (``--locust-users``, ``--locust-time``): failures and
   the load average;
2. load: ``--clients`` clients each holding a conversation (a turn every ~0.5 s; every other one pins
   its turns to the jobs pool, so some conversations lose their pool's replica whatever the placement)
   and ``--streams`` streams pinned to the jobs pool (``long`` in prod.yaml), plus ``--jobs`` jobs
   submitted to it (long enough to still run at the kill);
3. once a job runs, a worker node holding a jobs pool replica is killed (one that also holds some
   pool's only replica when there is one, ``pick_victim``) (its whole ``ray start``
   process group, SIGKILL) and the drill measures:

   - ``streams_ended_s``: the last in-flight stream's end after the kill, and how each ended (an SSE
     error event + ``[DONE]``, a normal finish, or a cut connection / hang -- the last two fail the drill);
   - ``first_ok_s``: the first new request (no pool named) answered 200 after the kill;
   - ``pool_back_s``: the first request pinned to the lost pool answered 200 (Serve rescheduled its
     replica on the surviving worker): the recovery time;
   - conversations: each took a turn after recovery; per conversation its stored turns are matched to
     its turns answered 200: a turn **lost** was answered 200 but is missing from the stored
     conversation, or is stored but was never answered (the client timed out or was cut). Other
     outcomes are counted apart: **refused cleanly** (503/429 with an error message and Retry-After:
     the conversation is as it was, the client may send the turn again -- not a lost conversation),
     409 (a turn still held the conversation's lock), no answer (client timeout / cut connection). A
     conversation is lost when it lost a turn or its turn after recovery was not a 200;
   - jobs: every job succeeded, each exactly once (attempts 2 for a job whose replica was lost: re-queued
     once, 1 for the others; none missing, none run a third time).

Prints each step and a JSON summary (``--out`` writes it too). Loopback only; stops what it started::

    python -m load_tests.node_loss_drill --out docs/cluster_node_loss.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from app.cli.local_cluster import LocalCluster, local_layout, port_free

REPO = Path(__file__).resolve().parents[1]
KEY = "node-loss-drill-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
log = logging.getLogger("sinkserve.node_loss_drill")


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_cluster(state: Path, port_base: int, http_port: int, config: str) -> LocalCluster:
    for p in local_layout(port_base, http_port).all_ports:
        if not port_free(p):
            raise SystemExit(f"port {p} is in use: pick --port-base / --port")
    env = {**os.environ, "SINKSERVE_API_KEYS": KEY, "SINKSERVE_OPERATOR_KEYS": KEY, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "app.cli", "cluster", "up", config, "--model", "reference",
                          "--port", str(http_port), "--port-base", str(port_base), "--state-dir", str(state)],
                         cwd=REPO, env=env, text=True, capture_output=True)
    if out.returncode != 0:
        if (state / "state.json").exists():
            LocalCluster.load(state).stop()
        raise SystemExit(f"cluster up failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    log.info("cluster up in %.0fs (load %s)", time.monotonic() - t0, loadavg())
    return LocalCluster.load(state)


def run_locust(urls: list[str], users: int, duration: str, csv: Path) -> dict:
    env = {**os.environ, "SINKSERVE_API_KEY": KEY, "SINKSERVE_HOSTS": ",".join(urls), "SINKSERVE_MAX_TOKENS": "16"}
    locust = str(Path(sys.executable).with_name("locust"))
    before = loadavg()
    subprocess.run([locust, "-f", str(REPO / "load_tests/locustfile.py"), "--headless", "-u", str(users), "-r", "4",
                    "-t", duration, "--host", urls[0], "--csv", str(csv), "--only-summary"],
                   cwd=REPO, env=env, capture_output=True, text=True)
    rows = list(csv.with_name(csv.name + "_stats.csv").read_text().splitlines())
    total = next(r for r in rows if r.split(",")[1] == "Aggregated").split(",")
    header = rows[0].split(",")
    row = dict(zip(header, total))
    return {"users": users, "time": duration, "proxies": len(urls), "requests": int(row["Request Count"]),
            "failures": int(row["Failure Count"]), "median_ms": float(row["Median Response Time"]),
            "p95_ms": float(row["95%"]), "rps": float(row["Requests/s"]), "load_before": before, "load_after": loadavg()}


class Load:
    """Conversation clients and pinned streams; records every outcome with its time."""

    def __init__(self, base: str, clients: int, pool: str) -> None:
        self.base, self.pool = base, pool
        self.stop = threading.Event()
        self.convs = [httpx.post(base + "/v1/conversations", headers=AUTH, timeout=30).json()["id"] for _ in range(clients)]
        self.turns: list[tuple[str, int, float, bool]] = []  # conversation, status, time, refused cleanly
        self.streams: dict[int, dict] = {}
        self.refusals: set[str] = set()  # the messages of the turns refused cleanly
        self.lock = threading.Lock()

    def client(self, conv: str, pinned: bool) -> None:
        n = 0
        extra = {"pool": self.pool} if pinned else {}
        with httpx.Client(base_url=self.base, headers=AUTH, timeout=60) as c:
            while not self.stop.is_set():
                try:
                    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"turn {n}"}],
                                                             "max_tokens": 4, "sinkserve": {"conversation_id": conv, **extra}})
                    status = r.status_code
                    clean = refused_cleanly(r)
                    if clean:
                        with self.lock:
                            self.refusals.add(f"{r.status_code} Retry-After {r.headers['retry-after']}: "
                                              f"{r.json()['error']['message']}")
                except httpx.HTTPError:
                    status, clean = -1, False
                with self.lock:
                    self.turns.append((conv, status, time.monotonic(), clean))
                n += 1
                time.sleep(0.5)

    def stream(self, i: int, first: threading.Event) -> None:
        body, t0 = b"", time.monotonic()
        rec = {"start": t0}
        try:
            with httpx.stream("POST", self.base + "/v1/completions", headers=AUTH, timeout=httpx.Timeout(120, read=90),
                              json={"prompt": f"drill stream {i}", "max_tokens": 900, "stream": True,
                                    "sinkserve": {"ignore_eos": True, "pool": self.pool}}) as r:
                for chunk in r.iter_bytes():
                    body += chunk
                    if b'"text"' in body:
                        first.set()
            text = body.decode(errors="replace")
            events = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]
            done = text.rstrip().endswith("data: [DONE]")
            if events and "error" in events[-1] and done:
                rec["end"] = "sse_error"
                rec["message"] = events[-1]["error"]["message"]
            elif events and done and events[-1].get("choices", [{}])[0].get("finish_reason"):
                rec["end"] = "finished"
            else:
                rec["end"] = "truncated"
        except httpx.HTTPError as e:
            rec["end"] = f"client_error {type(e).__name__}"
            first.set()
        rec["ended"] = time.monotonic()
        self.streams[i] = rec


def refused_cleanly(r: httpx.Response) -> bool:
    """A 503/429 the client may retry: an error body with a message, and a Retry-After."""
    if r.status_code not in (429, 503) or "retry-after" not in r.headers:
        return False
    try:
        return bool(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return False


def turn_outcomes(turns: list[tuple[str, int, float, bool]]) -> dict:
    """Counts of the turns that were not a 200, by kind (see the module docstring)."""
    out = {"refused_cleanly": 0, "conflict_409": 0, "no_answer": 0, "other": 0}
    for _, status, _, clean in turns:
        if status == 200:
            continue
        kind = "refused_cleanly" if clean else "conflict_409" if status == 409 else "no_answer" if status == -1 else "other"
        out[kind] += 1
    return out


def job(base: str, job_id: str) -> dict:
    return httpx.get(f"{base}/v1/jobs/{job_id}", headers=AUTH, timeout=30).json()


def first_ok(base: str, since: float, body: dict, limit_s: float, tries: list) -> float | None:
    """Seconds from ``since`` to the first 200 for ``body``; each try goes in ``tries`` as
    (sent after s, status or error, took s)."""
    while time.monotonic() - since < limit_s:
        t = time.monotonic()
        try:
            r = httpx.post(base + "/v1/completions", headers=AUTH, json=body, timeout=60)
            status: int | str = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        tries.append((round(t - since, 1), status, round(time.monotonic() - t, 2)))
        if status == 200:
            return time.monotonic() - since
        time.sleep(0.25)
    return None


def squeeze(tries: list) -> list:
    """Consecutive tries with the same status as one row: (first sent after s, status, count, longest took s)."""
    out: list = []
    for sent, status, took in tries:
        if out and out[-1][1] == status:
            out[-1] = (out[-1][0], status, out[-1][2] + 1, max(out[-1][3], took))
        else:
            out.append((sent, status, 1, took))
    return out


def pick_victim(placement: dict[str, list[str]], jobs_deployment: str) -> str:
    """A node holding a replica of the jobs pool, preferring one that also holds some pool's *only*
    replica (the case where Serve holds new calls until a replacement runs).

    >>> pick_victim({"pool-short-v1": ["worker-b"], "pool-long-v1": ["worker-a", "worker-b"]}, "pool-long-v1")
    'worker-b'
    >>> pick_victim({"pool-short-v1": ["worker-a", "worker-b"], "pool-long-v1": ["worker-b"]}, "pool-long-v1")
    'worker-b'
    """
    only = {nodes[0] for d, nodes in placement.items() if d.startswith("pool-") and len(nodes) == 1}
    holders = placement[jobs_deployment]
    return next((n for n in holders if n in only), holders[0])


def drill(c: LocalCluster, clients: int, streams: int, jobs: int) -> dict:
    base = f"http://127.0.0.1:{c.layout.http_port}"
    jobs_pool = "long"
    before = {d: c.replica_nodes(d) for d in ("Ingress", "StatsHub", "pool-short-v1", "pool-long-v1")}
    victim = pick_victim(before, f"pool-{jobs_pool}-v1")
    log.info("placement before: %s; killing %s (holds the jobs pool %r)", before, victim, jobs_pool)
    load = Load(base, clients, jobs_pool)
    workers = [threading.Thread(target=load.client, args=(conv, i % 2 == 1), daemon=True)
               for i, conv in enumerate(load.convs)]
    firsts = [threading.Event() for _ in range(streams)]
    workers += [threading.Thread(target=load.stream, args=(i, firsts[i]), daemon=True) for i in range(streams)]
    for w in workers[:clients]:
        w.start()
    # Jobs, then the streams once a job runs, then the kill as soon as the streams have their first
    # tokens: on a quiet host the reference model decodes a 900-token job or stream in seconds, so
    # waiting longer killed an idle node.
    ids = []
    for i in range(jobs):
        r = httpx.post(base + "/v1/jobs", headers=AUTH, timeout=30, json={"endpoint": "/v1/completions", "body": {
            "prompt": f"drill job {i}", "max_tokens": 900, "sinkserve": {"ignore_eos": True}}})
        r.raise_for_status()
        ids.append(r.json()["id"])
    deadline = time.monotonic() + 90
    running_at_kill: list[str] = []
    while time.monotonic() < deadline and not running_at_kill:
        running_at_kill = [j for j in ids if job(base, j)["status"] == "running"]
        time.sleep(0.1)
    for w in workers[clients:]:  # the streams once a job runs: each lasts seconds, and must outlive the kill
        w.start()
    # Any stream's first token: on a quiet host a 900-token stream lasts a second or two, so waiting for
    # every stream's first token let the first ones finish before the kill.
    until = time.monotonic() + 60
    while time.monotonic() < until and not any(f.is_set() for f in firsts):
        time.sleep(0.02)
    # No request between the streams' first tokens and the kill (a status poll under load took long
    # enough for the streams to finish): running_at_kill is the jobs running just before the streams.
    load_at_kill = loadavg()
    killed = time.monotonic()
    c.kill_node(victim)
    log.info("killed %s with %d streams in flight, jobs running %s (load %s)", victim, streams, running_at_kill, load_at_kill)
    any_tries: list = []
    pool_tries: list = []
    ok_any = first_ok(base, killed, {"prompt": "after the loss", "max_tokens": 4}, 180, any_tries)
    log.info("first new request served %.1fs after the kill", ok_any or -1)
    back = first_ok(base, killed, {"prompt": "after the loss", "max_tokens": 4, "sinkserve": {"pool": jobs_pool}}, 300,
                    pool_tries)
    log.info("the lost pool served again %.1fs after the kill", back or -1)
    for w in workers[clients:]:
        w.join(150)
    time.sleep(3.0)  # conversation turns after recovery
    load.stop.set()
    for w in workers[:clients]:
        w.join(90)
    # Every conversation: one more turn now, and its stored turns = its 200s.
    conv_report = []
    for conv in load.convs:
        r = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "messages": [{"role": "user", "content": "last"}], "max_tokens": 4, "sinkserve": {"conversation_id": conv}})
        ok = sum(1 for cv, s, _, _ in load.turns if cv == conv and s == 200) + (r.status_code == 200)
        stored = len(httpx.get(f"{base}/v1/conversations/{conv}", headers=AUTH, timeout=30).json()["turns"])
        conv_report.append({"ok_turns": ok, "stored_turns": stored, "last_turn": r.status_code,
                            "answered_not_stored": max(0, ok - stored), "stored_not_answered": max(0, stored - ok)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and any(job(base, j)["status"] not in ("succeeded", "failed", "cancelled") for j in ids):
        time.sleep(1.0)
    views = {j: job(base, j) for j in ids}
    failed_turns = [(s, round(t - killed, 1)) for _, s, t, _ in load.turns if s != 200]
    ends = sorted((s["end"], round(s["ended"] - killed, 1)) for s in load.streams.values())
    summary = {
        "victim": victim, "placement_before": before,
        "placement_after": {d: c.replica_nodes(d) for d in before},
        "load_at_kill": load_at_kill,
        "streams": {"in_flight": streams, "ends": ends,
                    "streams_ended_s": max(t for _, t in ends) if ends else None,
                    "messages": sorted({s.get("message", "") for s in load.streams.values()} - {""})},
        "first_ok_s": None if ok_any is None else round(ok_any, 1),
        "first_ok_tries": squeeze(any_tries),
        "pool_back_s": None if back is None else round(back, 1),
        "pool_back_tries": squeeze(pool_tries),
        "conversations": {"count": len(conv_report),
                          "lost": sum(1 for r in conv_report if r["answered_not_stored"] or r["stored_not_answered"]
                                      or r["last_turn"] != 200),
                          "turns_ok": sum(r["ok_turns"] for r in conv_report),
                          "turns_lost": {"answered_not_stored": sum(r["answered_not_stored"] for r in conv_report),
                                         "stored_not_answered": sum(r["stored_not_answered"] for r in conv_report)},
                          "turns_not_200": turn_outcomes(load.turns),
                          "refusal_messages": sorted(load.refusals),
                          "per_conversation": conv_report,
                          "turns_failed": failed_turns},
        "jobs": {"submitted": len(ids), "running_at_kill": len(running_at_kill),
                 "succeeded": sum(1 for v in views.values() if v["status"] == "succeeded"),
                 "attempts": sorted(v["attempts"] for v in views.values()),
                 "requeued_once": sum(1 for j in running_at_kill if views[j]["attempts"] == 2),
                 "statuses": sorted(v["status"] for v in views.values())},
    }
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="serve_configs/prod.yaml")
    ap.add_argument("--port-base", type=int, default=26800)
    ap.add_argument("--port", type=int, default=18100)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--locust-users", type=int, default=0, help="0: no Locust run")
    ap.add_argument("--locust-time", default="2m")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = Path(tempfile.mkdtemp(prefix="node-loss-"))
    c = start_cluster(state, a.port_base, a.port, a.config)
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": a.config,
                    "model": "reference"}
    try:
        if a.locust_users:
            result["locust"] = run_locust(c.proxy_urls(), a.locust_users, a.locust_time, state / "locust")
            log.info("locust: %s", result["locust"])
        result["node_loss"] = drill(c, a.clients, a.streams, a.jobs)
    finally:
        c.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
