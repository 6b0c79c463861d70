"""Where the CPU goes over HTTP at one stream: CPU seconds per process of `make run`'s app (the
`serve run` process tree: engine process, pool and ingress replicas, Ray's own) per token and per
request, for 64-token and 1-token completions (the latter: a request's fixed cost).

    python -m bench.http_cpu_split      # takes the Ray lock itself (like bench.http_llamacpp); ~1.5 min

A diagnostic beside bench.http_llamacpp (same server start, prompts and client), printed, not written
to docs: CPU time from /proc/<pid>/stat (clock ticks, 10 ms), so short runs read in steps of 10 ms.
"""
import asyncio
import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench import http_llamacpp as h


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Ray's workers included: raylet is a child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # exited meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """pid -> (command line, user + system CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                name = f.read().replace(b"\0", b" ").decode()[:90]
        except OSError:
            continue
        out[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user + system CPU seconds so far) for every thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
        except OSError:
            continue
        out[int(tid)] = (head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / tick)
    return out


def bus_frames(port: int) -> tuple[float, float]:
    """Token-bus frames and deltas sent by the pools so far (the StatsHub's view: up to a push
    interval old, so read it a second or more after the load)."""
    import httpx

    frames = deltas = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("sinkserve_token_bus_frames_total"):
            frames += float(line.rsplit(" ", 1)[1])
        elif line.startswith("sinkserve_token_bus_deltas_total"):
            deltas += float(line.rsplit(" ", 1)[1])
    return frames, deltas


def main() -> None:
    """Start the app, warm it, time 16 one-stream requests of 64 and of 1 token, print the split."""
    lock = open(h.RAY_LOCK, "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process exits: Ray starts and stops inside it
    tmp = Path(tempfile.mkdtemp())
    proc, port = h.start_sinkserve(h.REPO / "serve_configs" / "prod.yaml", h.REPO / "assets" / "reference-model", tmp)
    try:
        srv = h.Server("sinkserve", port, {"Authorization": f"Bearer {h.KEY}"}, {"sinkserve": {"ignore_eos": True}})
        prompts = h.make_prompts(40, 24)
        asyncio.run(h.run_level(srv, prompts[:8], 1, 64))  # warm
        for max_tokens in (64, 1):
            time.sleep(1.5)  # the hub's view of the bus counters catches up
            pids = process_tree(proc.pid)
            frames0 = bus_frames(port)
            threads = {p: thread_seconds(p) for p in pids}
            before, t = cpu_seconds(pids), time.perf_counter()
            r = asyncio.run(h.run_level(srv, prompts[8:24], 1, max_tokens))
            wall, after, n, reqs = time.perf_counter() - t, cpu_seconds(pids), r["completion_tokens"], r["requests"]
            threads_after = {p: thread_seconds(p) for p in pids}
            p50 = sorted(r["latency"])[reqs // 2]
            time.sleep(1.5)
            frames1 = bus_frames(port)
            print(f"max_tokens={max_tokens}: {reqs} requests, {n} tokens, wall {wall * 1e3:.0f} ms = "
                  f"{wall / reqs * 1e3:.1f} ms/request, p50 latency {p50 * 1e3:.1f} ms; token bus "
                  f"{frames1[0] - frames0[0]:.0f} frames, {frames1[1] - frames0[1]:.0f} deltas")
            used = sorted(((after[p][1] - before[p][1], after[p][0], p) for p in after if p in before), reverse=True)
            for dt, name, pid in used[:10]:
                if dt > 0:
                    print(f"  {dt * 1e3:7.0f} ms CPU  {dt / n * 1e3:6.3f} ms/token  {dt / reqs * 1e3:6.1f} ms/request  {name}")
                    # Its threads (Serve replicas: the actor's loop, the user-code loop, Ray's C++ threads).
                    now = threads_after[pid]
                    busy = sorted(((now[t][1] - threads[pid][t][1], now[t][0]) for t in now if t in threads[pid]), reverse=True)
                    print("           threads: " + ", ".join(f"{nm} {d * 1e3:.0f}" for d, nm in busy[:5] if d > 0))
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    finally:
        h.stop(proc)


if __name__ == "__main__":
    main()
