"""Compiled vs eager decode step (``EngineConfig.compile_decode``), side by side, plus start-up compile time.

Each configuration runs in its own process (a fresh dynamo state): ``ModelRunner`` on the model, decode
steps at each batch size with ``--context`` tokens cached (``bench.tp_cpu.decode_input``), min and median
over ``--steps`` steps. The compiled runs use a fresh inductor cache directory for the first start
("cold") and the same directory again for the second ("cached"); the logged compile seconds are
reported for both. Rounds alternate eager / compiled.

    python -m bench.compiled_step --out docs/compiled_step.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.report import emit  # noqa: E402


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from bench.tp_cpu import decode_input
    from engine import EngineConfig
    from engine.model_runner import ModelRunner

    batches = [int(b) for b in args.batch.split(",")]
    config = EngineConfig(model=args.model, max_num_seqs=max(batches), compile_decode=args.compiled)
    blocks = max(decode_input(b, args.context, config.block_size)[1] for b in batches)
    runner = ModelRunner(config, blocks)
    t = time.perf_counter()
    runner.warm_up()
    out: dict = {"start_s": time.perf_counter() - t, "compiled": runner.compiled is not None, "rows": {}}
    for b in batches:
        inp, _ = decode_input(b, args.context, config.block_size)
        for _ in range(5):
            runner.execute(inp)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.execute(inp)
            times.append(time.perf_counter() - t)
        out["rows"][b] = (min(times) * 1e3, statistics.median(times) * 1e3)
    print("RESULT " + json.dumps(out), flush=True)


def run(args: argparse.Namespace, compiled: bool, cache_dir: str) -> dict:
    argv = [sys.executable, "-m", "bench.compiled_step", "--child", "--model", args.model, "--batch", args.batch,
            "--context", str(args.context), "--steps", str(args.steps), "--threads", str(args.threads)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run(argv + (["--compiled"] if compiled else []), cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO_ROOT / "assets" / "reference-model"))
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    load = [os.getloadavg()[0]]
    eager, comp = [], []
    with tempfile.TemporaryDirectory(prefix="sinkserve-inductor-") as cache:
        for _ in range(args.rounds):
            eager.append(run(args, False, cache))
            comp.append(run(args, True, cache))  # round 1: cold cache; later rounds: cached
            load.append(os.getloadavg()[0])
    lines = [
        "# Compiled decode step vs eager",
        "",
        f"`python -m bench.compiled_step {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: model `{Path(args.model).name}`, {args.threads} "
        f"thread(s), context {args.context}, {args.steps} steps per batch size, {args.rounds} rounds alternating; "
        f"{os.cpu_count()} CPUs shared with other jobs, 1-minute load average {min(load):.1f}-{max(load):.1f}.",
        "",
        f"Start-up compile (all buckets up to {max(int(b) for b in args.batch.split(','))}): "
        f"{comp[0]['start_s']:.1f} s with an empty inductor cache, "
        + ", ".join(f"{c['start_s']:.1f} s" for c in comp[1:]) + " from the cache.",
        "",
        "| batch | eager ms/step (min / median) | compiled ms/step (min / median) | compiled / eager (medians) |",
        "|---:|---:|---:|---:|",
    ]
    for b in args.batch.split(","):
        e = [r["rows"][b] for r in eager]
        c = [r["rows"][b] for r in comp]
        de, dc = statistics.median(x[1] for x in e), statistics.median(x[1] for x in c)
        lines.append(f"| {b} | {min(x[0] for x in e):.2f} / {de:.2f} | {min(x[0] for x in c):.2f} / {dc:.2f} | "
                     f"{dc / de:.2f}x |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
