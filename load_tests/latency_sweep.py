"""Latency against input length: time to first token and per-token latency from 128 tokens to the
long pool's limit, over HTTP against a running app (the seeds' check for a non-linear blow-up).

    make run                                   # in another shell; note the printed key
    SINKSERVE_API_KEY=$KEY .venv/bin/python load_tests/latency_sweep.py

Prompts are token ids of plain text from the served model's tokenizer, so each request has exactly
the length asked for, and no two share a first block (the prefix cache would otherwise time a cache
hit instead of a prefill); one warm-up request per length, then ``--repeats`` streamed greedy
requests of ``--max-tokens`` tokens, one at a time (nothing else should load the app). Writes a
markdown table, the growth ratios and a log-log PNG.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from load_tests.common import start  # noqa: E402
logger = logging.getLogger("sinkserve.sweep")
TEXT = ("The keeper of the lighthouse wrote every evening in a small book: the wind, the ships, the colour of "
        "the water and the names of the birds that rested on the rail. ")


def prompt_ids(tokenizer_dir: str, n: int, salt: int = 0) -> list[int]:
    """``n`` token ids of repeated text. Each ``salt`` starts the text at another token and puts
    salt-derived tokens first, so no two requests share a first block: the prefix cache cannot serve
    a measured prompt from an earlier one (that would time a cache hit, not a prefill)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    unit = tok(TEXT, add_special_tokens=False)["input_ids"]
    start = salt % len(unit)
    ids = (unit * (n // len(unit) + 2))[start:start + n]
    rng = random.Random(salt)
    ids[:8] = [rng.choice(unit) for _ in range(min(8, n))]
    if tok.bos_token_id is not None:
        ids[0] = tok.bos_token_id
    return ids


def one(c: httpx.Client, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, mean gap between later tokens) of one streamed request, in seconds."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "logprobs": 0,
            "sinkserve": {"ignore_eos": True}}
    import json

    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            n = len(chunk["choices"][0].get("logprobs", {}).get("tokens") or [1])
            now = time.perf_counter()
            if first is None:
                first = now
                tokens = n - 1  # tokens that came with the first one
            else:
                tokens += n
            last = now
    gap = (last - first) / tokens if tokens else float("nan")
    return first - t0, gap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="http://127.0.0.1:8000")
    ap.add_argument("--tokenizer", default=str(REPO / "assets" / "reference-model"),
                    help="the served model's directory (for exact-length prompts)")
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192,16384,32767",
                    help="prompt lengths; the last should be the long pool's max_prompt_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "latency_sweep.md")
    args = ap.parse_args()
    key = start(args.host, "sweep")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    with httpx.Client(base_url=args.host, headers={"Authorization": f"Bearer {key}"}, timeout=1800) as c:
        for n in lengths:
            one(c, prompt_ids(args.tokenizer, n, salt=1000), 4)  # warm-up: this length's kernels and buckets
            runs = [one(c, prompt_ids(args.tokenizer, n, salt=i), args.max_tokens) for i in range(args.repeats)]
            ttft = statistics.median(r[0] for r in runs)
            gap = statistics.median(r[1] for r in runs)
            rows.append((n, ttft, gap))
            logger.info("%6d tokens: TTFT %.3f s, per token %.2f ms", n, ttft, gap * 1e3)
    base_n, base_t, base_g = rows[0]
    top_n, top_t, top_g = rows[-1]
    lines = [
        "# Latency against input length",
        "",
        f"`load_tests/latency_sweep.py` against `{args.host}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end): medians of {args.repeats} streamed "
        f"greedy requests of {args.max_tokens} tokens per length, one at a time.",
        "",
        "| prompt tokens | TTFT (s) | TTFT / TTFT(first) | length / length(first) | per-token latency (ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, t, g in rows:
        lines.append(f"| {n} | {t:.3f} | {t / base_t:.1f} | {n / base_n:.0f} | {g * 1e3:.2f} |")
    lines += [
        "",
        f"Growth from {base_n} to {top_n} tokens ({top_n / base_n:.0f}x the input): time to first token "
        f"{top_t / base_t:.1f}x, per-token latency {top_g / base_g:.2f}x. Linear prefill would be "
        f"{top_n / base_n:.0f}x; a TTFT ratio at or below that means no super-linear blow-up.",
        "",
        f"![latency against input length]({args.out.with_suffix('.png').name})",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ns = [r[0] for r in rows]
    ax.loglog(ns, [r[1] for r in rows], "o-", label="time to first token (s)")
    ax.loglog(ns, [r[2] for r in rows], "s-", label="per-token latency (s)")
    ax.loglog(ns, [base_t * n / base_n for n in ns], "k:", label="linear in length (from the first TTFT)")
    ax.set_xlabel("prompt tokens")
    ax.legend()
    ax.set_title("sinkserve: latency against input length")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
