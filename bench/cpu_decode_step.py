"""The C decode step (``sinkserve_kernels/cpu_decode.py``) against the eager native forward, per batch size.

``ModelRunner.execute`` of one decode step (``bench.tp_cpu.decode_input``: every sequence at
``--context`` cached tokens), the two paths alternating in rounds in one process, min and median ms per
step over ``--steps`` steps. Models: the reference model and ``bench.throughput``'s random Llama (hidden
256, 6 layers, ~6M parameters: 22 MB of float32 weights). Sets ``engine.models.llama.DECODE_KERNEL_MAX_ROWS``:
the largest batch at which the C step still wins. ``--threads-ab N``: the C step on one thread against the
C step on ``N`` (its thread team, ``sinkserve_kernels/csrc/team.c``) instead of eager against C.

    python -m bench.cpu_decode_step --out docs/cpu_decode_step.md
    python -m bench.cpu_decode_step --threads-ab 2 --batch 1,2,4,8,32 --rounds 3 --steps 150 --out docs/cpu_decode_threads.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import cpu_name  # noqa: E402
from bench.report import emit  # noqa: E402


def time_steps(runner, inp, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(5):
        runner.execute(inp)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(inp)
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--threads-ab", type=int, default=0, metavar="N",
                    help="compare the C step on 1 thread against N threads (instead of eager against C)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import engine.models.llama as llama
    from bench.throughput import build_model
    from bench.tp_cpu import decode_input
    from engine import EngineConfig
    from engine.worker.model_runner import ModelRunner

    batches = [int(b) for b in args.batch.split(",")]
    n = args.threads_ab
    # (column, C-step row limit, torch threads): eager vs C at --threads, or C at 1 vs C at N threads
    sides = ([("a", 1 << 30, 1), ("b", 1 << 30, n)] if n else
             [("a", 0, args.threads), ("b", 1 << 30, args.threads)])
    names = ("C step, 1 thread", f"C step, {n} threads") if n else ("eager", "C step")
    models = {"reference-model": REPO_ROOT / "assets" / "reference-model",
              "bench.throughput model": build_model(Path(tempfile.mkdtemp()) / "throughput")}
    load = [os.getloadavg()[0]]
    rows = []
    for name, path in models.items():
        config = EngineConfig(model=str(path), max_num_seqs=max(batches))
        runner = ModelRunner(config, max(decode_input(b, args.context, config.block_size)[1] for b in batches))
        for b in batches:
            inp, _ = decode_input(b, args.context, config.block_size)
            times: dict[str, list[float]] = {"a": [], "b": []}
            for _ in range(args.rounds):
                for path_name, limit, threads in sides:
                    llama.DECODE_KERNEL_MAX_ROWS = limit
                    torch.set_num_threads(threads)
                    times[path_name] += time_steps(runner, inp, args.steps)
            e, c = times["a"], times["b"]
            rows.append((name, b, min(e) * 1e3, statistics.median(e) * 1e3, min(c) * 1e3, statistics.median(c) * 1e3))
            load.append(os.getloadavg()[0])
            print(rows[-1], flush=True)
    lines = [
        "# The C decode step: one thread vs more" if n else "# The C decode step vs the eager native forward",
        "",
        f"`python -m bench.cpu_decode_step {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {cpu_name()}, {os.cpu_count()} CPUs shared with "
        f"other jobs (1-minute load {min(load):.1f}-{max(load):.1f}), "
        f"{f'1 vs {n} torch threads' if n else f'{args.threads} torch thread(s)'}, "
        f"`ModelRunner.execute` of one decode step at {args.context} cached tokens per sequence, {args.steps} steps x "
        f"{args.rounds} rounds per path, the paths alternating. ms per step, min / median.",
        "",
        f"| model | batch | {names[0]} | {names[1]} | {names[0]} / {names[1]} (medians) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, b, emin, emed, cmin, cmed in rows:
        lines.append(f"| {name} | {b} | {emin:.2f} / {emed:.2f} | {cmin:.2f} / {cmed:.2f} | {emed / cmed:.2f}x |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
