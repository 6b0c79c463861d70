"""A session's KV blocks read back from Redis: one script call per block (``get_block`` in a loop, the
restore before issue 39's follow-up) against ``get_blocks`` (``BATCH`` blocks per call), in one run.

A throwaway redis-server on a free port (bench.session_kv's), ``--blocks`` blocks of ``--block-bytes``
each (default 512 x 48 KiB: an ~8K-token SmolLM2 history at int4, 16-token blocks), the two readers
alternating for ``--rounds`` rounds. Milliseconds per restore, min / median, and the ratio of medians.

    python -m bench.redis_batch_read [--blocks 512] [--block-bytes 49152] [--rounds 5] [--out docs/x.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.report import emit  # noqa: E402
from bench.session_kv import redis_url  # noqa: E402
from engine.memory.kv_store_redis import BATCH, RedisKVStore  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-bytes", type=int, default=48 << 10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    load = [", ".join(f"{x:.2f}" for x in os.getloadavg())]
    with redis_url(None, "redis") as url:
        store = RedisKVStore(url or "", max_bytes=1 << 40, max_age_s=3600)
        keys = [f"{i:064x}-q" for i in range(args.blocks)]
        for i, k in enumerate(keys):
            store.put_block(k, bytes([i % 251]) * args.block_bytes)
        readers = {"per block": lambda: [store.get_block(k) for k in keys], "batched": lambda: store.get_blocks(keys)}
        assert readers["per block"]() == readers["batched"]()
        times: dict[str, list[float]] = {name: [] for name in readers}
        for _ in range(args.rounds):
            for name, read in readers.items():
                t = time.perf_counter()
                read()
                times[name].append((time.perf_counter() - t) * 1e3)
    load.append(", ".join(f"{x:.2f}" for x in os.getloadavg()))
    med = {n: statistics.median(t) for n, t in times.items()}
    lines = [
        "# Session KV restore from Redis: per-block reads vs batched",
        "",
        f"`python -m bench.redis_batch_read {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, a local redis-server, {os.cpu_count()} CPUs shared "
        f"with other jobs (load averages {load[0]} before, {load[1]} after). {args.blocks} blocks of "
        f"{args.block_bytes} bytes; batched: {BATCH} per script call. {args.rounds} rounds, alternating.",
        "",
        "| reader | script calls | ms per restore, min / median |",
        "|---|---:|---:|",
        f"| per block (`get_block` in a loop) | {args.blocks} | {min(times['per block']):.1f} / {med['per block']:.1f} |",
        f"| batched (`get_blocks`) | {-(-args.blocks // BATCH)} | {min(times['batched']):.1f} / {med['batched']:.1f} |",
        "",
        f"Per block / batched (medians): **{med['per block'] / med['batched']:.2f}x**.",
    ]
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
