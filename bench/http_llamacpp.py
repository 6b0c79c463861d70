"""Over HTTP: the sinkserve app as ``make run`` starts it against llama-cpp-python's OpenAI server, same
model, same prompts, 64-token completions, at 1 stream and at 16 concurrent streams.

Both servers are started here and stopped at the end:

* sinkserve: ``python -m app.cli serve serve_configs/prod.yaml`` (what ``make run`` runs: it execs
  ``serve run`` on the config, Ray cluster included) on free ports, the API key from
  ``SINKSERVE_API_KEYS``, stopped with SIGTERM to that ``serve run`` process. The whole run holds
  ``/tmp/sinkserve-ray.lock`` (the lock every Ray user on this host takes), so do not wrap the command
  in ``flock`` on the same file.
* llama.cpp: ``python -m llama_cpp.server`` from the venv ``bench/llamacpp.py`` builds (the package's
  ``[server]`` extra is added to it on first use), on the GGUF conversion that benchmark caches
  (``<venv>/gguf``; ``--outtype`` q8_0 by default: int8 weights, the precision `weight_dtype: auto` gives the engine on CPU).

Workload: ``--requests`` text completions at 1 stream (one after another) and ``--requests-16`` at 16
concurrent streams (16 closed-loop clients), each 64 tokens, greedy, EOS ignored (sinkserve:
``sinkserve.ignore_eos``; llama-cpp-python: ``logit_bias`` -100 on the tokenizer's special tokens,
which include both tokens its GGUF marks end-of-generation -- its ``min_tokens`` covers only the EOS id,
and 0.3.36 drops every logits processor when both are given, ``list.extend`` returning None), not streamed (each
answer's ``usage.completion_tokens`` counts its tokens). Tokens/s = completion tokens / wall time of the
level, client included (a small asyncio HTTP/1.1 client on keep-alive connections, the same for both).
llama-cpp-python's server runs one completion at a time (a lock around its one ``Llama``), so its
16-stream level measures its serial throughput under that load. Rounds alternate the two servers;
medians are reported.

    python -m bench.http_llamacpp --out docs/http_llamacpp.md
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.host import StealMeter, cpu_name  # noqa: E402
from bench.llamacpp import DEFAULT_VENV, convert, ensure_llamacpp, gguf_path, gguf_weight_types  # noqa: E402
from bench.local_app import free_port  # noqa: E402
from bench.report import emit  # noqa: E402

RAY_LOCK = "/tmp/sinkserve-ray.lock"
KEY = "bench-http-llamacpp"
WORDS = ("the river stone garden quiet morning lamp window letter bridge winter market song harbor forest "
         "engine silver paper candle mountain village story evening train cloud yellow ladder kitchen north "
         "blanket pocket anchor meadow lantern island orchard whistle velvet copper thunder").split()


def special_token_ids(model: Path) -> list[int]:
    """The ids of the tokenizer's special added tokens (BOS, EOS, pad, chat markers)."""
    tok = json.loads((model / "tokenizer.json").read_text())
    return [t["id"] for t in tok.get("added_tokens", []) if t.get("special")]


def make_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``words`` words; each starts with its own words, so neither server's
    prefix reuse (sinkserve's prefix cache, llama.cpp's kept context) spans two prompts beyond a word."""
    rng = random.Random(seed)
    return [f"{i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: POST a JSON body, read the JSON answer (Content-Length or
    chunked). Minimal on purpose: the client shares the two cores with the servers (see bench/serving.py)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{extra}Content-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:] if line)}
        if fields.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while size := int((await self.reader.readline()).strip(), 16):
                parts.append((await self.reader.readexactly(size + 2))[:-2])
            await self.reader.readline()
            payload = b"".join(parts)
        else:
            payload = await self.reader.readexactly(int(fields.get("content-length", "0")))
        if fields.get("connection", "").lower() == "close":
            self.writer.close()
            self.reader = self.writer = None
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {payload[:300]!r}")
        return json.loads(payload)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Server:
    """A server under test: its base URL, request headers and completion body."""

    def __init__(self, name: str, port: int, headers: dict[str, str], extra_body: dict) -> None:
        self.name, self.port, self.headers, self.extra_body = name, port, headers, extra_body

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **self.extra_body}


async def run_level(server: Server, prompts: list[str], conc: int, max_tokens: int) -> dict:
    """``prompts`` through ``conc`` closed-loop clients; tokens, wall time, per-request latencies."""
    conns = [HttpConnection("127.0.0.1", server.port, server.headers) for _ in range(conc)]
    todo = iter(prompts)
    out = {"completion_tokens": 0, "prompt_tokens": 0, "latency": []}

    async def client(c: HttpConnection) -> None:
        for p in todo:
            t = time.perf_counter()
            r = await c.post("/v1/completions", server.body(p, max_tokens))
            out["latency"].append(time.perf_counter() - t)
            out["completion_tokens"] += r["usage"]["completion_tokens"]
            out["prompt_tokens"] += r["usage"]["prompt_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*[client(c) for c in conns])
    out["wall_s"] = time.perf_counter() - t0
    out["tok_s"] = out["completion_tokens"] / out["wall_s"]
    out["requests"] = len(out["latency"])
    for c in conns:
        c.close()
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path, headers: dict[str, str] | None = None) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s:g}s; log: {log}")


def start_sinkserve(config: Path, model: Path, tmp: Path) -> tuple[subprocess.Popen, int]:
    """``make run``'s command on free ports; returns the ``serve run`` process (the CLI execs it) and the port."""
    port = free_port()
    log = tmp / "sinkserve.log"
    env = {**os.environ, "SINKSERVE_API_KEYS": KEY,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "app.cli", "serve", str(config), "--model", str(model), "--port", str(port),
           "--haproxy-stats-port", str(free_port()), "--haproxy-metrics-port", str(free_port()),
           "--key-file", str(tmp / "api_keys")]  # the effective config goes beside it, not into ~/.sinkserve
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc, 600, log)
    return proc, port


def start_llama(venv: Path, gguf: Path, threads: int, n_ctx: int, tmp: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = tmp / "llama_server.log"
    cmd = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 120, log)
    return proc, port


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> int | None:
    """SIGTERM to the process itself (for sinkserve: ``serve run``, which shuts down the Ray cluster it started)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
    return proc.returncode


def versions(venv: Path) -> str:
    import ray
    import torch
    import transformers

    llama = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import llama_cpp, fastapi, uvicorn; print(llama_cpp.__version__, fastapi.__version__, "
                            "uvicorn.__version__)"], capture_output=True, text=True).stdout.split()
    return (f"llama-cpp-python {llama[0]} (built from the sdist, `GGML_NATIVE=ON`; its server on FastAPI {llama[1]}, "
            f"uvicorn {llama[2]}); sinkserve on Ray {ray.__version__} (Serve, HAProxy entry), torch {torch.__version__}, "
            f"transformers {transformers.__version__}; Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "assets" / "reference-model")
    ap.add_argument("--config", type=Path, default=REPO / "serve_configs" / "prod.yaml", help="make run's config")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="llama-cpp-python's venv (bench/llamacpp.py's)")
    ap.add_argument("--outtype", default="q8_0", help="GGUF weight type (q8_0: int8, the engine's weight_dtype auto on CPU)")
    ap.add_argument("--llama-threads", type=int, default=1,
                    help="llama.cpp threads (1: what Ray gives the engine process of a pool with num_cpus < 1, "
                         "OMP_NUM_THREADS=1)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--requests", type=int, default=16, help="requests at 1 stream")
    ap.add_argument("--requests-16", type=int, default=64, help="requests at 16 streams")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    llama_dir = ensure_llamacpp(args.venv, server=True)
    gguf = convert(llama_dir, args.model, gguf_path(args.venv, args.model, args.outtype), args.outtype)
    cfg = json.loads((args.model / "config.json").read_text())
    prompts = make_prompts(args.requests + args.requests_16 + args.streams + 2, args.prompt_words)
    warm, p1, p16 = prompts[:2], prompts[2 : 2 + args.requests], prompts[2 + args.requests :]
    p16 = p16[: args.requests_16]
    tmp = Path(tempfile.mkdtemp(prefix="http_llamacpp-"))
    lock = open(RAY_LOCK, "a")
    t_lock = time.time()
    fcntl.flock(lock, fcntl.LOCK_EX)  # held until this process exits: Ray starts and stops inside it
    print(f"ray lock after {time.time() - t_lock:.0f}s; logs in {tmp}", flush=True)
    uptimes = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    procs: list[subprocess.Popen] = []
    results: dict[tuple[str, int], list[dict]] = {}
    steal = StealMeter()
    try:
        t = time.time()
        sink, sink_port = start_sinkserve(args.config, args.model, tmp)
        procs.append(sink)
        start_s = time.time() - t
        lp, llama_port = start_llama(args.venv, gguf, args.llama_threads, cfg.get("max_position_embeddings", 2048), tmp)
        procs.append(lp)
        servers = [
            Server("llama-cpp-python", llama_port, {}, {"logit_bias": {str(i): -100.0 for i in special_token_ids(args.model)}}),
            Server("sinkserve", sink_port, {"Authorization": f"Bearer {KEY}"}, {"sinkserve": {"ignore_eos": True}}),
        ]
        for s in servers:  # warm-up: first requests, one and two at a time
            asyncio.run(run_level(s, warm[:1], 1, args.max_tokens))
            asyncio.run(run_level(s, warm, 2, args.max_tokens))
        for r in range(args.rounds):
            for conc, ps in ((1, p1), (args.streams, p16)):
                for s in servers if r % 2 == 0 else servers[::-1]:
                    res = asyncio.run(run_level(s, ps, conc, args.max_tokens))
                    res["load"] = os.getloadavg()[0]
                    results.setdefault((s.name, conc), []).append(res)
                    print(f"round {r} {s.name} c={conc}: {res['tok_s']:.0f} tok/s ({res['completion_tokens']} tokens, "
                          f"{res['wall_s']:.2f}s, load {res['load']:.1f})", flush=True)
            uptimes.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    finally:
        codes = [stop(p) for p in reversed(procs)]
        print(f"servers stopped (exit codes {codes})", flush=True)
        lock.close()

    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in results.items()}
    lat = {k: statistics.median(statistics.median(x["latency"]) for x in v) for k, v in results.items()}
    ptoks = {k: v[0]["prompt_tokens"] / v[0]["requests"] for k, v in results.items()}
    c = args.streams
    one = med[("sinkserve", 1)] / med[("llama-cpp-python", 1)]
    many = med[("sinkserve", c)] / med[("llama-cpp-python", c)]
    paths = sorted({line.split("decode step:", 1)[1].strip() for line in (tmp / "sinkserve.log").read_text(errors="replace").splitlines()
                    if "decode step:" in line})
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# Over HTTP: sinkserve (`make run`) vs llama-cpp-python's server",
        "",
        f"`python -m bench.http_llamacpp {cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{args.rounds} rounds (the two servers alternate; medians).",
        "",
        f"**Host:** {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs; CPU stolen by the "
        f"hypervisor during the run: {steal.percent() or 0:.1f} %. `uptime` before, after each round: "
        + "; ".join(f"`{u}`" for u in uptimes),
        "",
        f"**Versions:** {versions(args.venv)}.",
        "",
        f"**Servers:** sinkserve = `python -m app.cli serve {args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config}` "
        f"(what `make run` runs; up in {start_s:.0f} s), requests to its `short` pool; llama-cpp-python = "
        f"`python -m llama_cpp.server --n_threads {args.llama_threads}` on `{gguf.name}` "
        f"({gguf_weight_types(llama_dir, gguf)}). Model `{args.model.name}`. The engine's logged decode steps: "
        + ("; ".join(f"`{p}`" for p in paths) or "none logged to the driver"),
        "",
        f"**Workload:** text prompts of {args.prompt_words} words (prompt tokens per request: sinkserve "
        f"{ptoks[('sinkserve', 1)]:.1f}, llama-cpp-python {ptoks[('llama-cpp-python', 1)]:.1f}, each tokenizing the "
        f"text itself), {args.max_tokens}-token completions, greedy, EOS ignored, not streamed; "
        f"{args.requests} requests at 1 stream, {args.requests_16} at {c} streams (closed loop). "
        "Tokens/s = completion tokens / wall time, client included.",
        "",
        "| streams | sinkserve tok/s | llama-cpp-python tok/s | sinkserve p50 latency | llama-cpp-python p50 latency |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in (1, c):
        lines.append(f"| {n} | {med[('sinkserve', n)]:.0f} | {med[('llama-cpp-python', n)]:.0f} | "
                     f"{lat[('sinkserve', n)] * 1000:.0f} ms | {lat[('llama-cpp-python', n)] * 1000:.0f} ms |")
    lines += [
        "",
        "| target | measured | |",
        "|---|---:|---|",
        f"| 1 stream >= 1.0x llama-cpp-python's server | {one:.2f}x | {'met' if one >= 1.0 else 'MISSED'} |",
        f"| {c} streams >= 3x llama-cpp-python's server at {c} streams (it serves one at a time) | {many:.2f}x | "
        f"{'met' if many >= 3 else 'MISSED'} |",
        "",
        "Per round, tok/s (sinkserve / llama-cpp-python): "
        + "; ".join(f"1 stream {results[('sinkserve', 1)][i]['tok_s']:.0f} / {results[('llama-cpp-python', 1)][i]['tok_s']:.0f}, "
                    f"{c} streams {results[('sinkserve', c)][i]['tok_s']:.0f} / {results[('llama-cpp-python', c)][i]['tok_s']:.0f}"
                    for i in range(args.rounds)),
        "",
    ]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
