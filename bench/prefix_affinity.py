"""Prefix affinity on vs off: requests that share a long opening, two pool replicas each, one run.

    nice -n 10 python -m bench.prefix_affinity [--rounds 4] [--docs 6] [--tails 4] [--kv-blocks 160]
        [--out docs/prefix_affinity.json]

One application, the reference model (assets/reference-model), two pools of 2 replicas each that differ
only in routing: ``aff`` sets ``prefix_affinity_tokens`` (requests without a session ranked by a hash of
their first 128 tokens, app/pool/prefix_affinity.py) and ``p2c`` does not (Serve's power of two choices). Each
round makes ``--docs`` fresh openings (a ~600-token "document" each) with ``--tails`` distinct questions
each, shuffles the requests once, and sends that same sequence, one request at a time, streamed, to each
pool; the pool order alternates per round. Per request: TTFT at the client (request sent to the first
SSE data event) and the prompt tokens the replica found in its prefix cache (the audit log's
``cached_tokens``). Reports per pool the token hit rate (cached / prompt tokens), the share of requests
that found their opening cached, and mean TTFT, with aff/p2c ratios, and the load average beside them
(the host is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.local_app import REPO, start_local_app

KEY = "sk-bench-prefix"
PREFIX_TOKENS = 128
WORDS = ("river stone lamp orchard copper violet harbor thistle lantern meadow quartz falcon ember willow cedar "
         "marble signal beacon tundra saffron glacier pepper walnut cobalt").split()


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def app_args(audit: str, kv_blocks: int) -> dict[str, Any]:
    engine = {"max_model_len": 1024, "num_kv_blocks": kv_blocks, "max_num_batched_tokens": 512, "max_num_seqs": 4,
              "cache_policy": {"eviction_policy": "none"}}
    pool = {"max_prompt_tokens": 900, "timeout_s": 120, "num_cpus": 0.05, "num_replicas": 2, "affinity_max_load": 8,
            "engine": engine}
    return {
        "model": str(REPO / "assets/reference-model"),
        "served_model_name": "ref",
        "ingress": {"num_replicas": 1, "num_cpus": 0.05},
        "pools": [{"name": "aff", "prefix_affinity_tokens": PREFIX_TOKENS, **pool}, {"name": "p2c", **pool}],
        "audit": {"path": audit},
        "stats_push_interval_s": 1.0,
    }


def opening(rng: random.Random, tag: str) -> str:
    return f"Document {tag}. " + " ".join(rng.choice(WORDS) + str(rng.randrange(10)) for _ in range(150)) + "\n"


def ttft(c: Any, pool: str, prompt: str) -> tuple[str, float]:
    """Stream one completion; (its id, seconds to the first data event)."""
    body = {"model": "ref", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "sinkserve": {"pool": pool}}
    t0 = time.perf_counter()
    first = None
    rid = None
    with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if first is None:
                    first = time.perf_counter() - t0
                    rid = json.loads(line[6:])["id"]
    assert first is not None and rid is not None
    return rid, first


def audit(path: Path, ids: set[str], timeout_s: float = 30) -> dict[str, dict]:
    deadline = time.time() + timeout_s
    while True:
        recs = {}
        for x in path.read_text().splitlines():
            d = json.loads(x)
            if d["request_id"] in ids:
                recs[d["request_id"]] = d
        if len(recs) == len(ids) or time.time() > deadline:
            return recs
        time.sleep(0.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--tails", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import httpx
    from ray import serve

    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    audit_path = tmp / "audit.jsonl"
    os.environ["SINKSERVE_OPERATOR_KEYS"] = KEY  # forcing a pool (sinkserve.pool) is an operator option
    base = start_local_app(app_args(str(audit_path), a.kv_blocks), KEY, ready_timeout_s=300)
    rng = random.Random(a.seed)
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            for pool in ("aff", "p2c"):  # warm-up: first-request costs (imports, compiled paths) out of the figures
                for i in range(4):
                    ttft(c, pool, f"warm-up {i} " + opening(rng, f"w{i}"))
            for rnd in range(a.rounds):
                docs = [opening(rng, f"{rnd}-{d}") for d in range(a.docs)]
                reqs = [(d, f"Question {t}: which word follows {rng.choice(WORDS)}{t} in document {d}?")
                        for d in range(a.docs) for t in range(a.tails)]
                rng.shuffle(reqs)
                order = ("aff", "p2c") if rnd % 2 == 0 else ("p2c", "aff")
                for pool in order:
                    la = load()
                    sent = [(d, *ttft(c, pool, docs[d] + tail)) for d, tail in reqs]
                    recs = audit(audit_path, {rid for _, rid, _ in sent})
                    for d, rid, t in sent:
                        r = recs[rid]
                        rows.append({"round": rnd, "pool": pool, "doc": d, "ttft_s": t, "prompt_tokens": r["prompt_tokens"],
                                     "cached_tokens": r["cached_tokens"], "load": la})
                    print(f"round {rnd} {pool}: load {la}", flush=True)
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    summary = summarize(rows)
    summary.update({"rounds": a.rounds, "docs": a.docs, "tails": a.tails, "kv_blocks": a.kv_blocks,
                    "prefix_affinity_tokens": PREFIX_TOKENS,
                    "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()})
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "requests": rows}, indent=1) + "\n")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pool: token hit rate, share of requests that found their opening (>= PREFIX_TOKENS cached),
    mean TTFT; per round the same, so the spread between rounds shows."""
    def stats(rs: list[dict[str, Any]]) -> dict[str, float]:
        return {"hit_rate": round(sum(r["cached_tokens"] for r in rs) / sum(r["prompt_tokens"] for r in rs), 3),
                "opening_found": round(sum(r["cached_tokens"] >= PREFIX_TOKENS for r in rs) / len(rs), 3),
                "mean_ttft_ms": round(1000 * sum(r["ttft_s"] for r in rs) / len(rs), 1),
                "requests": len(rs)}
    out: dict[str, Any] = {p: stats([r for r in rows if r["pool"] == p]) for p in ("aff", "p2c")}
    out["ttft_ratio_aff_over_p2c"] = round(out["aff"]["mean_ttft_ms"] / out["p2c"]["mean_ttft_ms"], 3)
    out["per_round"] = [{"round": rnd, **{p: {**stats([r for r in rows if r["round"] == rnd and r["pool"] == p]),
                                           "load": next(r["load"] for r in rows if r["round"] == rnd and r["pool"] == p)}
                                          for p in ("aff", "p2c")}}
                        for rnd in sorted({r["round"] for r in rows})]
    return out


if __name__ == "__main__":
    main()
