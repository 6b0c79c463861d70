"""Where serving latency goes: time to first token when entering the running application at each hop.

    .venv/bin/python bench/serving_hops.py            # tiny random Llama, 1 and 8 concurrent streams

Entry points, from the inside out (each includes everything after it):

    pool     handle -> LLMServer.generate (stream)                       engine + 1 streaming hop
    router   handle -> Router.route (plan, then stream from the pool)    + the router's work + 1 hop
    ingress  HTTP  -> Serve proxy -> Ingress -> Router.plan -> pool      the full HTTP path
    healthz  HTTP  -> Serve proxy -> Ingress (no model work)             the proxy + ingress floor

Also the unary ``Router.plan`` call on its own. Prints a markdown table (p50 / p90 in ms).
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
    from app.streaming import stream_plan

    router = serve.get_deployment_handle("Router", app_name="sinkserve")
    out: dict[str, list[float]] = {k: [] for k in ("plan", "pool", "router", "ingress", "healthz")}

    def request(p: str) -> CompletionRequest:
        return CompletionRequest(prompt=p, max_tokens=max_tokens, temperature=0.0, sinkserve={"ignore_eos": True})

    async def via_pool(p: str) -> None:
        t0 = time.perf_counter()
        plan = await router.plan.remote(request(p))
        out["plan"].append(time.perf_counter() - t0)
        pool = serve.get_deployment_handle(plan.info.deployment, app_name="sinkserve")
        t0 = time.perf_counter()
        async for ev in stream_plan(pool, plan):
            if getattr(ev, "token_ids", None) and t0 is not None:
                out["pool"].append(time.perf_counter() - t0)
                t0 = None

    async def via_router(p: str) -> None:
        t0 = time.perf_counter()
        async for ev in router.options(stream=True).route.remote(request(p)):
            if getattr(ev, "token_ids", None) and t0 is not None:
                out["router"].append(time.perf_counter() - t0)
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

        for fn in (via_pool, via_router, via_http, healthz):
            await fn(prompts[0])  # warm this path
        for k in out:
            out[k].clear()
        for fn in (via_pool, via_router, via_http, healthz):
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
