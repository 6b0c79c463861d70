"""Soak test: a bounded mixed load against a running sinkserve app, with every replica's memory watched.

    make run                                   # in another shell; note the printed key
    SINKSERVE_API_KEY=$KEY .venv/bin/python load_tests/soak.py --minutes 30 --clients 8

Traffic (loopback only, bounded in time; each client thinks 0-0.5 s between requests):

    kind          share  what
    short-stream   50 %  streamed completion, 100-300 word prompt (short pool), 32-64 tokens
    short-unary    15 %  the same, not streamed
    long-stream    15 %  streamed, 1,500-3,000 word prompt (long pool), 32 tokens
    cancelled      15 %  streamed, the client closes the connection after 3 chunks (server: 499)
    session         5 %  chat turn with a session_id (version stickiness), 16 tokens

Every ``--sample-s`` seconds it records the RSS of each process of the app (the descendants of its
``serve run`` process: Serve replicas by deployment, engine child processes, TP workers, HAProxy) and
the KV blocks in use per pool from /metrics. At the end it waits for the app to go idle and checks:
no errors other than the deliberate cancellations, every process's RSS within +10 % from minute 5 to
the end, no process replaced by another of its kind (a restart), and KV blocks back to 0 in every pool. Writes a markdown report and a
PNG (RSS and KV blocks over time); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load_tests.common import start  # noqa: E402
logger = logging.getLogger("sinkserve.soak")

WORDS = ("the river carries light past old stone walls while the city sleeps and the market waits for "
         "morning bread and letters arrive from distant towns with news of rain").split()
KINDS = (("short-stream", 0.50), ("short-unary", 0.15), ("long-stream", 0.15), ("cancelled", 0.15), ("session", 0.05))


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pick_kind(rng: random.Random) -> str:
    u, acc = rng.random(), 0.0
    for kind, share in KINDS:
        acc += share
        if u < acc:
            return kind
    return KINDS[-1][0]


@dataclass
class Tally:
    """What the clients saw: counts by (kind, outcome), time to first token by kind."""

    outcomes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)

    def error(self, kind: str, what: str) -> None:
        self.outcomes[(kind, "error")] += 1
        if len(self.errors) < 50:
            self.errors.append(f"{kind}: {what}")


async def one_request(c: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally) -> None:
    if kind == "session":
        body = {"messages": [{"role": "user", "content": words(rng.randint(20, 60), rng)}], "max_tokens": 16,
                "stream": True, "sinkserve": {"session_id": f"soak-{rng.randint(0, 20)}"}}
        path = "/v1/chat/completions"
    else:
        n = rng.randint(1500, 3000) if kind == "long-stream" else rng.randint(100, 300)
        body = {"prompt": words(n, rng), "max_tokens": 32 if kind == "long-stream" else rng.randint(32, 64),
                "temperature": 0.8, "stream": kind != "short-unary", "sinkserve": {"ignore_eos": True}}
        path = "/v1/completions"
    t0 = time.perf_counter()
    if not body["stream"]:
        r = await c.post(path, json=body)
        if r.status_code != 200:
            tally.error(kind, f"HTTP {r.status_code}: {r.text[:160]}")
            return
        tally.ttft[kind].append(time.perf_counter() - t0)
        tally.outcomes[(kind, "ok")] += 1
        return
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            tally.error(kind, f"HTTP {r.status_code}: {(await r.aread())[:160]!r}")
            return
        chunks, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            if '"error"' in line[:20]:
                tally.error(kind, line[:200])
                return
            chunks += 1
            if chunks == 1:
                tally.ttft[kind].append(time.perf_counter() - t0)
            if kind == "cancelled" and chunks >= 3:
                tally.outcomes[(kind, "cancelled")] += 1
                return  # leaving the block closes the connection mid-stream
        if done:
            tally.outcomes[(kind, "ok")] += 1
        else:
            tally.error(kind, f"stream ended without [DONE] after {chunks} chunks")


async def client_loop(base: str, key: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600) as c:
        while time.monotonic() < deadline:
            kind = pick_kind(rng)
            try:
                await one_request(c, kind, rng, tally)
            except httpx.HTTPError as e:
                tally.error(kind, f"{type(e).__name__}: {e}")
            await asyncio.sleep(rng.uniform(0.0, 0.5))


# ---- what the app's processes use -----------------------------------------------------------------


def server_pid() -> int:
    """The ``serve run`` process of the app on this machine (``make run`` execs it); the app's
    processes are its descendants, so other Ray clusters on the machine are not counted."""
    found = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
             if "serve run" in " ".join(p.info["cmdline"] or []) and "python" in " ".join(p.info["cmdline"] or [])]
    if len(found) != 1:
        raise SystemExit(f"expected one `serve run` process, found {found}; pass --server-pid")
    return found[0]


def label_of(cmd: str) -> str | None:
    """What a process of the app is: a Serve replica by deployment, an engine child, a TP worker, HAProxy."""
    if cmd.startswith("ray::ServeReplica:"):
        # ray::ServeReplica:<app>:<deployment>, with ".<method>" appended while a call runs
        return cmd.split()[0].split(":")[-1].split(".")[0]
    if "engine.frontend.engine_process" in cmd:
        return "engine-process"
    if cmd.startswith("ray::TPWorkerActor"):
        return "tp-worker"
    if "haproxy" in cmd.split(" ")[0]:
        return "haproxy"
    return None


def app_processes(root: int) -> dict[int, str]:
    """pid -> label for the app's processes (descendants of ``root``)."""
    out: dict[int, str] = {}
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            label = label_of(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        if label is not None:
            out[p.pid] = label
    return out


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def kv_used(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    used: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(text):
        if fam.name == "sinkserve_kv_blocks_used":
            for s in fam.samples:
                used[s.labels["pool"]] += s.value
    return dict(used)


async def sampler(base: str, root: int, deadline: float, every_s: float, t_start: float, samples: list[dict]) -> None:
    while True:
        now = time.monotonic()
        procs = app_processes(root)
        samples.append({"t_min": (now - t_start) / 60,
                        "procs": {str(pid): [label, rss_mb(pid)] for pid, label in procs.items()},
                        "kv": await asyncio.to_thread(kv_used, base)})
        if now >= deadline:
            return
        await asyncio.sleep(min(every_s, max(0.0, deadline - now)))


# ---- report ---------------------------------------------------------------------------------------


def restarts(samples: list[dict]) -> list[str]:
    """Replacements seen between consecutive samples: a process of some label gone and a new one of
    the same label in its place (scaling a deployment down or up alone is not a restart)."""
    events = []
    for prev, cur in zip(samples, samples[1:]):
        by_label: dict[str, tuple[set, set]] = defaultdict(lambda: (set(), set()))
        for pid, (label, _) in prev["procs"].items():
            by_label[label][0].add(pid)
        for pid, (label, _) in cur["procs"].items():
            by_label[label][1].add(pid)
        for label, (before, after) in by_label.items():
            n = min(len(before - after), len(after - before))
            if n:
                events.append(f"{label} x{n} at minute {cur['t_min']:.1f}")
    return events


def evaluate(samples: list[dict], tally: Tally, settle_kv: dict[str, float], minutes: float) -> tuple[list[str], list[str]]:
    """Checks (each a line) and the failures among them."""
    lines, failed = [], []
    errors = sum(n for (_, outcome), n in tally.outcomes.items() if outcome == "error")
    line = f"errors other than deliberate cancellations: {errors}"
    lines.append(line)
    if errors:
        failed.append(line)
    warm = min(5.0, minutes / 6)  # minute 5 of a 30-minute soak; a sixth of a shorter one
    base_row = next((s for s in samples if s["t_min"] >= warm), samples[0])
    end = samples[-1]
    for pid, (label, start) in sorted(base_row["procs"].items(), key=lambda kv: (kv[1][0], kv[0])):
        last = end["procs"].get(pid, [None, None])[1]
        if start is None or last is None:
            continue  # a replica that scaled away meanwhile
        growth = (last - start) / start * 100
        line = (f"RSS {label} (pid {pid}): {start:.0f} MB at minute {base_row['t_min']:.1f} -> {last:.0f} MB "
                f"at the end ({growth:+.1f} %)")
        lines.append(line)
        if growth > 10.0:
            failed.append(line)
    events = restarts(samples)
    line = f"processes replaced (restarts): {events or 'none'}"
    lines.append(line)
    if events:
        failed.append(line)
    line = f"KV blocks in use after the load stopped: {settle_kv}"
    lines.append(line)
    if any(v != 0 for v in settle_kv.values()):
        failed.append(line)
    return lines, failed


def plot(samples: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    pids = sorted({pid for s in samples for pid in s["procs"]}, key=lambda p: (samples[-1]["procs"].get(p, ["~"])[0], p))
    for pid in pids:
        pts = [(s["t_min"], s["procs"][pid][1]) for s in samples if s["procs"].get(pid, [None, None])[1] is not None]
        label = next(s["procs"][pid][0] for s in samples if pid in s["procs"])
        ax1.plot([t for t, _ in pts], [r for _, r in pts], label=f"{label} {pid}")
    ax1.set_ylabel("RSS (MB)")
    ax1.legend(fontsize=7, ncol=2)
    ax1.set_title("sinkserve soak: memory of every process, KV blocks in use")
    for pool in sorted({p for s in samples for p in s["kv"]}):
        ax2.plot([s["t_min"] for s in samples], [s["kv"].get(pool, 0) for s in samples], label=f"pool {pool}")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("KV blocks used")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="http://127.0.0.1:8000")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--server-pid", type=int, help="the app's `serve run` process (default: found by name)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "soak.md")
    args = ap.parse_args()
    key = start(args.host, "soak")
    root = args.server_pid or server_pid()
    tally = Tally()
    samples: list[dict] = []

    async def run() -> dict[str, float]:
        t_start = time.monotonic()
        deadline = t_start + args.minutes * 60
        tasks = [asyncio.create_task(client_loop(args.host, key, i, deadline, tally)) for i in range(args.clients)]
        tasks.append(asyncio.create_task(sampler(args.host, root, deadline, args.sample_s, t_start, samples)))
        await asyncio.gather(*tasks)
        # The load has stopped: the KV cache must drain to nothing.
        settle = {}
        for _ in range(120):
            settle = await asyncio.to_thread(kv_used, args.host)
            if all(v == 0 for v in settle.values()):
                break
            await asyncio.sleep(1.0)
        return settle

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    settle = asyncio.run(run())
    checks, failed = evaluate(samples, tally, settle, args.minutes)
    png = args.out.with_suffix(".png")
    plot(samples, png)
    load = os.getloadavg()[0]
    by_kind = defaultdict(dict)
    for (kind, outcome), n in sorted(tally.outcomes.items()):
        by_kind[kind][outcome] = n
    lines = [
        "# Soak test",
        "",
        f"`load_tests/soak.py --minutes {args.minutes:g} --clients {args.clients}` against `{args.host}`, started "
        f"{started}, on {os.cpu_count()} CPUs (load average {load:.1f} at the end). Verdict: "
        f"**{'PASS' if not failed else 'FAIL'}**.",
        "",
        "| kind | ok | cancelled (deliberate) | errors | TTFT p50 (s) | TTFT p90 (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, _ in KINDS:
        o = by_kind.get(kind, {})
        t = tally.ttft.get(kind, [])
        lines.append(f"| {kind} | {o.get('ok', 0)} | {o.get('cancelled', 0)} | {o.get('error', 0)} | "
                     f"{pct(t, .5):.3f} | {pct(t, .9):.3f} |")
    lines += ["", "Checks:", ""] + [f"- {c}" for c in checks]
    if tally.errors:
        lines += ["", "First errors:", ""] + [f"- `{e}`" for e in tally.errors[:10]]
    lines += ["", f"![RSS and KV blocks over time]({png.name})", "",
              "Samples (minute, RSS MB per process, KV blocks per pool) are in "
              f"`{args.out.with_suffix('.json').name}`."]
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(samples, indent=1))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
