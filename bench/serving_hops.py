"""Where serving latency goes: time to first token when entering the running application at each hop.

    .venv/bin/python bench/serving_hops.py            # tiny random Llama, 1 and 8 concurrent streams

Entry points, from the inside out (each includes everything after it):

    handle   Ray handle -> Ingress.generate (plan, pool call, tokens on the bus)   engine + the request path
    ingress  HTTP -> HAProxy -> Ingress (the same, plus HTTP and SSE)               the full HTTP path
    healthz  HTTP -> HAProxy -> Ingress (no model work)                             the entry + ingress floor

Prints a markdown table (p50 / p90 in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import KEY, pct, start_app  # noqa: E402


async def measure(base: str, prompts: list[str], conc: int, max_tokens: int) -> dict[str, list[float]]:
    import httpx
    from ray import serve

    from app.schemas import CompletionRequest

    ingress = serve.get_app_handle("sinkserve")
    out: dict[str, list[float]] = {k: [] for k in ("handle", "ingress", "healthz")}

    def request(p: str) -> CompletionRequest:
        return CompletionRequest(prompt=p, max_tokens=max_tokens, temperature=0.0, sinkserve={"ignore_eos": True})

    async def via_handle(p: str) -> None:
        t0 = time.perf_counter()
        async for ev in ingress.options(stream=True).generate.remote(request(p)):
            if getattr(ev, "token_ids", None) and t0 is not None:
                out["handle"].append(time.perf_counter() - t0)
                t0 = None

    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:

        async def via_http(p: str) -> None:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                    "sinkserve": {"ignore_eos": True}}
            t0 = time.perf_counter()
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and t0 is not None:
                        out["ingress"].append(time.perf_counter() - t0)
                        t0 = None

        async def healthz(_: str) -> None:
            t0 = time.perf_counter()
            (await c.get("/healthz")).raise_for_status()
            out["healthz"].append(time.perf_counter() - t0)

        for fn in (via_handle, via_http, healthz):
            await fn(prompts[0])  # warm this path
        for k in out:
            out[k].clear()
        for fn in (via_handle, via_http, healthz):
            for i in range(0, len(prompts), conc):
                await asyncio.gather(*[fn(p) for p in prompts[i: i + conc]])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    from tests.serve.tiny_model import make_tiny_model

    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog. " * 3 for i in range(args.requests)]
    base = start_app(model)
    rows = {conc: asyncio.run(measure(base, prompts, conc, args.max_tokens)) for conc in (1, 8)}
    from ray import serve

    serve.shutdown()
    print("| streams | " + " | ".join(f"{k} p50 / p90" for k in rows[1]) + " |")
    print("| ---: |" + " ---: |" * len(rows[1]))
    for conc, r in rows.items():
        print(f"| {conc} | " + " | ".join(f"{pct(v, .5) * 1e3:.1f} / {pct(v, .9) * 1e3:.1f}" for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
