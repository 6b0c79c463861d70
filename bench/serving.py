"""Serving overhead: TTFT and ITL through HTTP (HAProxy -> ingress -> pool) versus the same engine
in-process, at 1 and 8 concurrent streams. Writes docs/serving_benchmark.md (--out).

    .venv/bin/python bench/serving.py                      # tiny random Llama (fast, CPU)
    .venv/bin/python bench/serving.py --model assets/reference-model
    .venv/bin/python bench/serving.py --proxy serve --plan-in deployment   # the design sketch's path

The HTTP side runs the real application (Ray Serve, num_cpus=2, auth on) on 127.0.0.1 with one
replica per deployment; the in-process side drives ``AsyncLLMEngine`` with the same EngineConfig.
Overhead = p50(HTTP) - p50(in-process) per metric and concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.host import StealMeter, describe  # noqa: E402

ENGINE = {"num_kv_blocks": 256, "max_model_len": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 512}
KEY = "bench-key"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def drive(one, prompts: list[str], conc: int, mode: str) -> None:
    """Run ``one(slot, prompt)`` over ``prompts`` with ``conc`` streams in flight.

    ``burst``: groups of ``conc`` requests start together and the next group starts when the whole
    group is done (all eight arrive at once: the worst case for time to first token).
    ``steady``: ``conc`` closed-loop clients, each sending its next request when its last one ends
    (like vLLM's ``benchmark_serving --max-concurrency``); with output lengths that differ, arrivals
    spread out and ``conc`` streams stay in flight.
    """
    if mode == "burst":
        for i in range(0, len(prompts), conc):
            await asyncio.gather(*[one(slot, p) for slot, p in enumerate(prompts[i : i + conc])])
        return
    todo = iter(prompts)

    async def client(slot: int) -> None:
        for p in todo:
            await one(slot, p)

    await asyncio.gather(*[client(slot) for slot in range(conc)])


def max_tokens_for(prompt_index: int, mode: str, max_tokens: int) -> int:
    """``burst``: every request ``max_tokens``; ``steady``: from max_tokens/2 to 3*max_tokens/2
    (same mean), fixed per request index so both sides of the comparison get the same work."""
    if mode == "burst":
        return max_tokens
    return max_tokens // 2 + (prompt_index * 7) % (max_tokens + 1)


async def run_inprocess(model: str, prompts: list[str], conc: int, max_tokens: int, mode: str) -> tuple[list[float], list[float]]:
    from engine.config import EngineConfig
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.sampling_params import SamplingParams

    eng = AsyncLLMEngine(EngineConfig(model=model, **ENGINE))
    index = {p: i for i, p in enumerate(prompts)}
    ttft, itl = [], []

    async def one(slot: int, p: str) -> None:
        # logprobs: the same work as the HTTP side, which asks for them to count tokens per chunk.
        params = SamplingParams(max_tokens=max_tokens_for(index[p], mode, max_tokens), temperature=0.0, ignore_eos=True,
                                logprobs=True)
        times = StreamTimes(ttft, itl)
        async for out in eng.generate(p, params):
            if out.token_ids:
                times.chunk(len(out.token_ids))

    await one(0, prompts[0])  # warm-up
    ttft.clear(), itl.clear()
    await drive(one, prompts, conc, mode)
    await eng.shutdown()
    return ttft, itl


class SSEConnection:
    """A minimal HTTP/1.1 client for one keep-alive connection: POST, then the chunked SSE body.

    Why not httpx: the client shares the two cores with the server, and httpx spends ~15 ms of CPU per
    32-token stream here (request building, line iteration) against ~3 ms for this; that CPU is the
    client's, not serving overhead. ``--client httpx`` measures with httpx for comparison.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        )
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        if head.split(b" ", 2)[1] != b"200" or b"transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"unexpected response: {head[:200]!r}")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks (each an SSE event here) until the terminating zero-size chunk."""
        assert self.reader is not None
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return
            yield (await self.reader.readexactly(size + 2))[:-2]


class StreamTimes:
    """Time to first token and per-token gaps of one stream, from the arrival of its chunks (a
    chunk of n tokens spreads its gap over the n, so ITL stays per token)."""

    def __init__(self, ttft: list[float], itl: list[float]) -> None:
        self.ttft, self.itl = ttft, itl
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.seen = 0

    def chunk(self, n: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft.append(now - self.t0)
            self.itl.extend([0.0] * (n - 1))  # tokens that came with the first one: no gap
        else:
            self.itl.extend([(now - self.last) / n] * n)
        self.seen += n
        self.last = now


def chunk_tokens(event: bytes, seen: int) -> int:
    """Tokens in one SSE completion chunk, counted exactly: the requests ask ``logprobs: 0``, so each
    chunk lists its tokens (the ingress merges deltas that piled up, so one chunk can hold several).
    Without logprobs, what the final chunk's usage adds up to, else 1."""
    body = json.loads(event[6:])
    lp = (body.get("choices") or [{}])[0].get("logprobs")
    if lp and lp.get("tokens") is not None:
        return len(lp["tokens"])
    usage = body.get("usage")
    return max(1, usage["completion_tokens"] - seen) if usage else 1


async def run_http_raw(base: str, prompts: list[str], conc: int, max_tokens: int, mode: str) -> tuple[list[float], list[float]]:
    host, port = base.split("//")[1].split(":")
    conns = [SSEConnection(host, int(port)) for _ in range(conc)]
    index = {p: i for i, p in enumerate(prompts)}
    ttft, itl = [], []

    async def one(slot: int, p: str) -> None:
        c = conns[slot]
        body = {"prompt": p, "max_tokens": max_tokens_for(index[p], mode, max_tokens), "temperature": 0.0,
                "stream": True, "logprobs": 0, "sinkserve": {"ignore_eos": True}}
        times = StreamTimes(ttft, itl)
        await c.post("/v1/completions", body)
        async for event in c.chunks():
            for line in event.split(b"\n"):
                if line.startswith(b"data: {"):
                    times.chunk(chunk_tokens(line, times.seen))

    await one(0, prompts[0])
    ttft.clear(), itl.clear()
    await drive(one, prompts, conc, mode)
    return ttft, itl


async def run_http(base: str, prompts: list[str], conc: int, max_tokens: int, mode: str) -> tuple[list[float], list[float]]:
    import httpx

    index = {p: i for i, p in enumerate(prompts)}
    ttft, itl = [], []
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:

        async def one(slot: int, p: str) -> None:
            body = {"prompt": p, "max_tokens": max_tokens_for(index[p], mode, max_tokens), "temperature": 0.0,
                    "stream": True, "logprobs": 0, "sinkserve": {"ignore_eos": True}}
            times = StreamTimes(ttft, itl)
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    # Every completion chunk carries >= 1 token (a partial UTF-8 token can have
                    # empty text), so the first chunk is the first token.
                    if line.startswith("data: {"):
                        times.chunk(chunk_tokens(line.encode(), times.seen))

        await one(0, prompts[0])
        ttft.clear(), itl.clear()
        await drive(one, prompts, conc, mode)
    return ttft, itl


def start_app(model: str, ingress_replicas: int = 1) -> str:
    from bench.local_app import start_local_app

    args = {
        "model": model, "ingress": {"num_replicas": ingress_replicas},
        "pools": [{"name": "short", "max_prompt_tokens": 900, "num_cpus": 0.5, "engine": ENGINE}],
        "stats_push_interval_s": 2.0,
    }
    return start_local_app(args, KEY, ready_timeout_s=60.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: a tiny random Llama)")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--requests-8", type=int, default=None,
                    help="requests for the 8-stream levels (default: --requests); their p50 moves by a few ms "
                         "between runs, and they are cheap, so a few hundred more steady the figure")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "serving_benchmark.md")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="HTTP client: a minimal asyncio one (default), or httpx (~5x its CPU per stream)")
    ap.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (prod.yaml runs 2)")
    ap.add_argument("--modes", default="burst,steady",
                    help="how 8 streams arrive: burst (together), steady (closed loop, output lengths vary)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.serve.tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    n8 = args.requests_8 or args.requests
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog. " * 3 for i in range(max(args.requests, n8))]
    level_prompts = lambda conc: prompts[: args.requests if conc == 1 else n8]  # noqa: E731
    # 1 stream: fixed lengths; 8 streams: arriving together (burst) and closed-loop (steady).
    levels = [(1, "burst")] + [(8, m) for m in args.modes.split(",")]
    results = {}
    steal = StealMeter()
    for conc, mode in levels:
        results[("in-process", conc, mode)] = asyncio.run(run_inprocess(model, level_prompts(conc), conc, args.max_tokens, mode))
    base = start_app(model, args.ingress_replicas)
    client = run_http_raw if args.client == "raw" else run_http
    for conc, mode in levels:
        results[("http", conc, mode)] = asyncio.run(client(base, level_prompts(conc), conc, args.max_tokens, mode))
    from ray import serve

    serve.shutdown()

    rows = []
    for conc, mode in levels:
        ip_t, ip_i = results[("in-process", conc, mode)]
        h_t, h_i = results[("http", conc, mode)]
        label = "1" if conc == 1 else f"{conc}, {mode}"
        rows.append((label, pct(ip_t, .5), pct(h_t, .5), pct(h_t, .9), pct(ip_i, .5), pct(h_i, .5), pct(h_i, .9)))
    ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
    lines = [
        "# Serving overhead benchmark",
        "",
        f"`bench/serving.py` on {describe(steal)}, model "
        f"`{Path(model).name if args.model else 'tiny random Llama (2 layers, hidden 64)'}`, "
        f"{args.requests} streamed requests at 1 stream and {n8} per 8-stream level, {args.max_tokens} tokens each (steady: "
        f"{args.max_tokens // 2}-{args.max_tokens * 3 // 2}, same mean), greedy, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "HTTP = client -> HAProxy -> Ingress (plans: tokenize, bucket) -> pool (LLMServer) -> engine (child "
        "process), tokens back engine -> Ingress on the token bus -> SSE; "
        f"client: {'minimal asyncio HTTP/1.1' if args.client == 'raw' else 'httpx'}; "
        "in-process = `AsyncLLMEngine.generate` in the benchmark process. ITL is per token: requests ask "
        "`logprobs: 0` on both sides so every chunk lists its tokens, and a chunk of n tokens counts n gaps "
        "of (its delay / n). All times in ms.",
        "",
        "| streams | TTFT p50 in-proc | TTFT p50 HTTP | TTFT p90 HTTP | **TTFT p50 overhead** | ITL p50 in-proc | ITL p50 HTTP | ITL p90 HTTP | **ITL p50 overhead** |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for conc, it, ht, ht9, ii, hi, hi9 in rows:
        lines.append(f"| {conc} | {ms(it)} | {ms(ht)} | {ms(ht9)} | **{ms(ht - it)}** | {ms(ii)} | {ms(hi)} | {ms(hi9)} | **{ms(hi - ii)}** |")
    lines += ["", "Target: p50 overhead at most 30 ms."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
