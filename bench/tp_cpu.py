"""Tensor parallelism on this CPU: per-token decode time of the model at TP=2 against TP=1, side by side.

Each TP=2 rank is its own process (as a Ray TP worker is), joined the way ``app.pool.tp_executor`` joins them
(``deepspeed.init_distributed`` over gloo, DeepSpeed's shared-memory all-reduce when it is built), and
runs the same decode steps as the TP=1 process: a batch of ``B`` sequences, each with ``--context``
tokens cached. This is the step alone -- no Ray round trip, no scheduler -- so it is the best case for
TP; over HTTP the per-step Ray hop adds to it. Rounds alternate TP=1 / TP=2 so load drifts hit both.

    python -m bench.tp_cpu --out docs/tp_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.report import emit  # noqa: E402


def decode_input(batch: int, context: int, block_size: int):  # type: ignore[no-untyped-def]
    """One decode step: ``batch`` sequences at position ``context``, each on its own blocks (from block 1)."""
    from engine.worker.model_runner import ModelInput

    nb = -(-(context + 1) // block_size)
    inp = ModelInput([], [], [], [], [], [0], [])
    for b in range(batch):
        table = list(range(1 + b * nb, 1 + (b + 1) * nb))
        inp.input_ids.append(5)
        inp.positions.append(context)
        inp.slot_mapping.append(table[context // block_size] * block_size + context % block_size)
        inp.block_tables.append(table)
        inp.seq_lens.append(context + 1)
        inp.query_start_loc.append(b + 1)
        inp.logits_indices.append(b)
    return inp, batch * nb + 1


def rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """One rank: time ``args.steps`` decode steps per batch size; rank 0 prints ``batch ms`` lines."""
    import torch

    torch.set_num_threads(args.threads)
    from engine import EngineConfig
    from engine.worker.model_runner import ModelRunner

    if world_size > 1:
        import deepspeed

        from app.pool.tp_executor import dist_env

        os.environ.update(dist_env(rank, world_size, port, "cpu", 0))
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    config = EngineConfig(model=args.model, model_impl=args.model_impl, max_num_seqs=max(args.batch))
    for b in args.batch:
        inp, blocks = decode_input(b, args.context, config.block_size)
        runner = ModelRunner(config, blocks, rank, world_size)
        for _ in range(5):
            runner.execute(inp)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.execute(inp)
            times.append(time.perf_counter() - t)
        if rank == 0:
            print(f"RESULT {b} {min(times) * 1e3:.3f} {statistics.median(times) * 1e3:.3f}", flush=True)


def run(world_size: int, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """Start ``world_size`` rank processes; ``{batch: (min ms, median ms)}`` per step."""
    from app.pool.tp_executor import free_port

    port = free_port()
    argv = [sys.executable, "-m", "bench.tp_cpu", "--rank-of", str(world_size), "--port", str(port)] + args.passthrough
    procs = [subprocess.Popen(argv + ["--rank", str(r)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
             for r in range(world_size)]
    out = procs[0].communicate()[0]
    for p in procs[1:]:
        p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"TP={world_size} ranks failed: {[p.returncode for p in procs]}")
    res = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            _, b, mn, med = line.split()
            res[int(b)] = (float(mn), float(med))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO_ROOT / "assets" / "reference-model"))
    p.add_argument("--model-impl", default="auto")
    p.add_argument("--batch", default="1,16", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (TP=1 gets the same)")
    p.add_argument("--out", type=Path)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch = [int(x) for x in str(args.batch).split(",")]
    if args.rank is not None:
        rank_main(args.rank, args.rank_of, args.port, args)
        return 0
    args.passthrough = ["--model", args.model, "--model-impl", args.model_impl, "--batch", ",".join(map(str, args.batch)),
                        "--context", str(args.context), "--steps", str(args.steps), "--threads", str(args.threads)]
    rounds: dict[int, list[dict[int, tuple[float, float]]]] = {1: [], 2: []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for ws in (1, 2):
            rounds[ws].append(run(ws, args))
            load.append(os.getloadavg()[0])
    lines = [
        "# Tensor parallelism on CPU: TP=2 vs TP=1 per decode step",
        "",
        f"`python -m bench.tp_cpu {' '.join(sys.argv[1:] if argv is None else argv)}` -- host {platform.node()}, "
        f"{os.cpu_count()} CPUs, {args.threads} torch thread(s) per process, model `{Path(args.model).name}` "
        f"({args.model_impl}), context {args.context} tokens, {args.steps} steps x {args.rounds} rounds "
        f"(alternating), 1-min load average {min(load):.1f}-{max(load):.1f} during the run.",
        "",
        "| batch | TP=1 ms/step (min / median) | TP=2 ms/step (min / median) | TP=2 / TP=1 (medians) |",
        "|---:|---:|---:|---:|",
    ]
    for b in args.batch:
        one = [r[b] for r in rounds[1]]
        two = [r[b] for r in rounds[2]]
        m1, m2 = min(x[0] for x in one), min(x[0] for x in two)
        d1, d2 = statistics.median(x[1] for x in one), statistics.median(x[1] for x in two)
        lines.append(f"| {b} | {m1:.2f} / {d1:.2f} | {m2:.2f} / {d2:.2f} | {d2 / d1:.2f}x |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
