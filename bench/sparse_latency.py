"""Latency against context length, dense vs sparse attention (CPU, a random-weight model where attention
dominates): decode ms/token and time to first token of a chunked prefill.

    nice -n 10 .venv/bin/python bench/sparse_latency.py [--quick] [--out docs/sparse_attention_latency]

Model: Llama shape, 2 layers, 8 query heads = 8 KV heads of head_dim 128 (hidden 1024), MLP 256, vocab 256,
dummy weights, float32. The engine's model runner runs every step (the same ``ModelInput`` the engine
builds): decode steps read a cache of ``L`` tokens filled with random keys/values (latency does not depend
on their values; the block bounds are computed from them as the cache writes would), prefill runs
``L`` tokens in chunks of ``CHUNK`` (the engine's ``max_num_batched_tokens``) and stops at the first
token's logits. Sparse: ``SPARSE`` (top_k 2048 tokens + forced set: sink block, newest 256 tokens),
from 4,096 tokens of context on. Targets (issue 23): sparse decode at 32K / 2K <= 2.0, sparse TTFT at
32K / 4K <= 10.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.host import cpu_name  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.worker.model_runner import ModelInput, ModelRunner  # noqa: E402
from engine.worker.sparse_config import SparseAttention  # noqa: E402
from sinkserve_kernels import block_sparse  # noqa: E402

logger = logging.getLogger("bench.sparse_latency")

BS = 16
CHUNK = 2048
SPARSE = SparseAttention(enabled=True, indexer="block_bounds", top_k=2048, min_context=4096, local_window=256)
MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "bos_token_id": 0, "eos_token_id": 1,
}


def make_runner(model_dir: Path, max_len: int) -> ModelRunner:
    cfg = EngineConfig(model=str(model_dir), load_format="dummy", dtype="float32", block_size=BS,
                       num_kv_blocks=max_len // BS + 2, max_num_batched_tokens=CHUNK, max_model_len=max_len,
                       enable_prefix_caching=False, sparse=SPARSE)
    return ModelRunner(cfg, num_kv_blocks=max_len // BS + 2)


def step_input(start: int, n: int, sparse: bool) -> ModelInput:
    """Tokens ``start .. start + n - 1`` of one sequence whose block i is physical block i + 1."""
    seq_len = start + n
    table = list(range(1, -(-seq_len // BS) + 1))
    inp = ModelInput([7] * n, list(range(start, seq_len)), [table[p // BS] * BS + p % BS for p in range(start, seq_len)],
                     [table], [seq_len], [0, n], [n - 1])
    use = sparse and seq_len >= SPARSE.min_context
    inp.sparse_forced = [[0] if use else None]  # the sink block is the protection set
    return inp


def fill_cache(runner: ModelRunner, length: int) -> None:
    """Random keys/values for ``length`` tokens, and their block bounds (what prefill writes would leave)."""
    g = torch.Generator().manual_seed(0)
    nb = -(-length // BS)
    ids = torch.arange(1, nb + 1)
    for (k, v), bounds in zip(runner.kv_caches, runner.block_bounds):
        k[1 : nb + 1] = torch.randn(k[1 : nb + 1].shape, generator=g)
        v[1 : nb + 1] = torch.randn(v[1 : nb + 1].shape, generator=g)
        block_sparse.set_bounds(bounds, ids, k[ids])


def decode_ms(runner: ModelRunner, length: int, sparse: bool, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) milliseconds of a decode step at ``length`` tokens of context."""
    fill_cache(runner, length)
    runner.execute(step_input(length - 1, 1, sparse))  # warm-up
    walls, cpus = [], []
    for i in range(steps):
        t, c = time.perf_counter(), time.process_time()
        runner.execute(step_input(length - 1, 1, sparse))  # the same position: the cache does not grow
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    # The median step: a shared host's load spikes hit single steps, not the typical one.
    return statistics.median(walls) * 1000, statistics.median(cpus) * 1000


def ttft_s(runner: ModelRunner, length: int, sparse: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of the chunked prefill of ``length`` tokens to the first token's logits. CPU time
    (this process, one torch thread) leaves out the time other jobs on a shared host held the core."""
    t, c = time.perf_counter(), time.process_time()
    for start in range(0, length, CHUNK):
        runner.execute(step_input(start, min(CHUNK, length - start), sparse))
    return time.perf_counter() - t, time.process_time() - c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short lengths (smoke run)")
    ap.add_argument("--out", default=str(REPO / "docs" / "sparse_attention_latency"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: more thrash with 2 on a loaded host)")
    ap.add_argument("--steps", type=int, default=15, help="timed decode steps per point (median reported)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over all points; each point's best is reported")
    ap.add_argument("--dense-prefill-max", type=int, default=8192, help="longest dense prefill (memory: T x L scores)")
    ap.add_argument("--baseline", action="append", default=[], metavar="LABEL=JSON",
                    help="an earlier run's json, drawn faded in the plot under LABEL (history)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    decode_lengths = [512, 1024] if args.quick else [2048, 4096, 8192, 16384, 32768]
    prefill_lengths = [1024, 2048] if args.quick else [2048, 4096, 8192, 16384, 32768]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(MODEL))
        runner = make_runner(model_dir, max(decode_lengths + prefill_lengths) + CHUNK)
        args.backend_name = runner.backend.name
        # Rounds over every point (not repeats of one point): a load spike on the shared host then costs one
        # round of some points, and the best round of each point is reported.
        # Wall and CPU time are each the best round of the point (independently).
        best: dict[tuple[str, int, str], list[float]] = {}
        rounds: list[dict] = []
        for rnd in range(args.repeats):
            for length in decode_lengths:
                for sparse in (False, True):
                    ms = decode_ms(runner, length, sparse, args.steps)
                    key = ("decode", length, "sparse" if sparse else "dense")
                    best[key] = [min(a, b) for a, b in zip(ms, best.get(key, ms))]
                    rounds.append({"round": rnd, "kind": "decode", "L": length, "mode": key[2], "value": ms[0],
                                   "cpu": ms[1]})
                    logger.info("round %d decode L=%d %s: %.1f ms/token (CPU %.1f)", rnd, length, key[2], *ms)
            for length in prefill_lengths:
                for sparse in (False, True):
                    if not sparse and length > args.dense_prefill_max:
                        continue
                    s = ttft_s(runner, length, sparse)
                    key = ("ttft", length, "sparse" if sparse else "dense")
                    best[key] = [min(a, b) for a, b in zip(s, best.get(key, s))]
                    rounds.append({"round": rnd, "kind": "ttft", "L": length, "mode": key[2], "value": s[0], "cpu": s[1]})
                    logger.info("round %d ttft L=%d %s: %.2f s (CPU %.2f)", rnd, length, key[2], *s)
        rows = [{"kind": k, "L": n, "mode": m, "value": v[0], "cpu": v[1]} for (k, n, m), v in best.items()]
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    write(rows, rounds, Path(args.out), args, load_before, load_after, time.perf_counter() - t0)
    return 0


def ratio(rows: list[dict], kind: str, mode: str, a: int, b: int, field: str = "value") -> float | None:
    v = {r["L"]: r[field] for r in rows if r["kind"] == kind and r["mode"] == mode}
    return v[a] / v[b] if a in v and b in v else None


def write(rows: list[dict], rounds: list[dict], out: Path, args: argparse.Namespace, load_before: list[str],
          load_after: list[str], wall: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    lengths = sorted({r["L"] for r in rows})
    hi = max(lengths)
    dec_lo, pre_lo = min(r["L"] for r in rows if r["kind"] == "decode"), 4096 if 4096 in lengths else min(lengths)
    checks = []
    for kind, mode, lo, bound in (("decode", "sparse", dec_lo, 2.0), ("decode", "dense", dec_lo, None),
                                  ("ttft", "sparse", pre_lo, 10.0)):
        r = ratio(rows, kind, mode, hi, lo)
        if r is not None:
            verdict = f" (target <= {bound:g}: {'MET' if r <= bound else 'MISSED'})" if bound else " (report)"
            per_round = [ratio([x for x in rounds if x["round"] == i], kind, mode, hi, lo) for i in range(args.repeats)]
            checks.append(f"{kind} {mode}: L={hi} / L={lo} = {r:.2f}{verdict}; CPU time "
                          f"{ratio(rows, kind, mode, hi, lo, 'cpu'):.2f}; single rounds (wall) "
                          + ", ".join(f"{x:.2f}" for x in per_round if x is not None))
    dense_pre = {r["L"]: r["value"] for r in rows if r["kind"] == "ttft" and r["mode"] == "dense"}
    if len(dense_pre) >= 2:
        a, b = max(dense_pre), min(dense_pre)
        checks.append(f"ttft dense: L={a} / L={b} = {dense_pre[a] / dense_pre[b]:.2f} (report; dense prefill stops at "
                      f"{a} tokens: its T x L scores would not fit this shared host beyond)")
    lines = [
        "# Sparse attention: latency against context length (CPU)", "",
        f"`nice -n 10 .venv/bin/python bench/sparse_latency.py{' --quick' if args.quick else ''} --threads "
        f"{args.threads} --steps {args.steps} --repeats {args.repeats}` -- one run; host {cpu_name()}, torch threads {args.threads}, "
        f"decode = median of {args.steps} steps; each point the best of {args.repeats} rounds over all points; "
        f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; wall {wall:.0f} s. "
        "Wall time is the target's measure; CPU time (this process) is shown beside it because the host is "
        "shared: it leaves out the time other jobs held the core (not their cache and memory traffic).", "",
        "Model: Llama shape, 2 layers, 8 query heads = 8 KV heads x head_dim 128 (hidden 1024), MLP 256, vocab 256, "
        f"dummy weights, float32, {args.backend_name} attention backend. Sparse: block_bounds indexer, top_k 2048 tokens + forced set "
        "(sink block, newest 256 tokens), from 4,096 tokens of context; prefill in chunks of "
        f"{CHUNK} tokens (queries select in groups of {block_sparse.PREFILL_GROUP}). Decode reads a cache of L random "
        "tokens (bounds computed from them); TTFT runs the whole chunked prefill to the first token's logits.", "",
        "| kind | L | dense | sparse | sparse / dense | dense CPU | sparse CPU |", "|---|---|---|---|---|---|---|",
    ]
    for kind, unit in (("decode", "ms/token"), ("ttft", "s")):
        for length in lengths:
            pick = {m: next((r for r in rows if r["kind"] == kind and r["L"] == length and r["mode"] == m), None)
                    for m in ("dense", "sparse")}
            if pick["dense"] is None and pick["sparse"] is None:
                continue
            fmt = (lambda x: f"{x:.1f} {unit}") if kind == "decode" else (lambda x: f"{x:.2f} {unit}")
            cell = lambda m, f: fmt(pick[m][f]) if pick[m] is not None else "-"  # noqa: E731
            d, s = (pick[m]["value"] if pick[m] else None for m in ("dense", "sparse"))
            lines.append(f"| {kind} | {length} | {cell('dense', 'value')} | {cell('sparse', 'value')} | "
                         f"{f'{s / d:.2f}' if d and s else '-'} | {cell('dense', 'cpu')} | {cell('sparse', 'cpu')} |")
    lines += ["", "Against the targets:", ""] + [f"- {c}" for c in checks]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "rounds": rounds, "checks": checks,
                                                    "load_before": load_before,
                                                    "load_after": load_after, "threads": args.threads}, indent=1))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    earlier = [(b.split("=", 1)[0], json.loads(Path(b.split("=", 1)[1]).read_text())["rows"]) for b in args.baseline]
    for ax, kind, ylabel in ((axes[0], "decode", "decode ms/token"), (axes[1], "ttft", "time to first token (s)")):
        for label, old in earlier:
            pts = sorted((r["L"], r["value"]) for r in old if r["kind"] == kind and r["mode"] == "sparse")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ":x", color="grey", alpha=0.6,
                        label=f"sparse, {label}")
        for mode, style in (("dense", "-s"), ("sparse", "-o")):
            pts = sorted((r["L"], r["value"]) for r in rows if r["kind"] == kind and r["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length L (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("dense vs block_bounds sparse attention (top_k 2048 + forced set), CPU")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
