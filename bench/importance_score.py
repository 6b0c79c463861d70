"""Which running score should importance eviction keep per block? Side by side on the same inputs.

Issue 37 item 4: the H2O-style running *sum* of attention mass (``retention.accumulate_importance``) favours
age -- an old block has been observed by more steps -- so over a long stream importance kept old blocks and
cost +25 % perplexity at a 25 % budget (docs/retention.md). Candidates, each patched in for one run:

    sum        s_b += m_b                      (H2O; the rule before this comparison)
    mean       s_b = mean of m_b over the steps that observed b   (age-neutral)
    decay:G    s_b = G * s_b + m_b             (recent steps weigh more; G per step)
    max        s_b = max(s_b, m_b)             (once important, always important)

Measured per rule: long-stream perplexity at 25 % / 50 % (chunked prefill, eviction between chunks: the
question-not-in-view setting) and the needle at 25 % with the question in view (one prefill, then
eviction) and streamed in 128-token chunks (question not in view). ``m_b`` is the step's attention mass of
block ``b`` from the last 32 queries (engine/worker/importance.py).

    python -m bench.importance_score --rules sum,mean,decay:0.5,decay:0.8,max --out docs/importance_score
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from engine.memory import retention

Rule = Callable[[list[float], Sequence[float]], None]


def make_rule(name: str) -> Rule:
    """The accumulate function of rule ``name`` (see the module docstring)."""
    if name == "sum":
        return _sum
    if name == "max":
        def rule(acc: list[float], scores: Sequence[float]) -> None:
            _grow(acc, len(scores))
            for i, s in enumerate(scores):
                acc[i] = max(acc[i], s)
        return rule
    if name.startswith("decay:"):
        g = float(name.split(":", 1)[1])

        def rule(acc: list[float], scores: Sequence[float]) -> None:
            _grow(acc, len(scores))
            for i, s in enumerate(scores):
                acc[i] = g * acc[i] + s
        return rule
    if name == "mean":
        sums: dict[int, list[list[float]]] = {}  # id(acc) -> [sums, counts]; a bench-only side table

        def rule(acc: list[float], scores: Sequence[float]) -> None:
            _grow(acc, len(scores))
            st = sums.setdefault(id(acc), [[], []])
            for part in st:
                part.extend([0.0] * (len(scores) - len(part)))
            for i, s in enumerate(scores):
                if s > 0.0:  # observed this step (an evicted or unwritten block scores exactly 0)
                    st[0][i] += s
                    st[1][i] += 1
                    acc[i] = st[0][i] / st[1][i]
        return rule
    raise SystemExit(f"--rules: unknown rule {name!r} (sum, mean, max, decay:G)")


def _grow(acc: list[float], n: int) -> None:
    if len(acc) < n:
        acc.extend([0.0] * (n - len(acc)))


def _sum(acc: list[float], scores: Sequence[float]) -> None:
    _grow(acc, len(scores))
    for i, s in enumerate(scores):
        acc[i] += s


def main(argv: list[str] | None = None) -> int:
    from evals import arms as A
    from evals import eviction
    from evals.report import EvalResult, markdown_table, write_report

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the reference model")
    ap.add_argument("--rules", default="sum,mean,decay:0.5,decay:0.8,max")
    ap.add_argument("--tokens", type=int, default=None, help="stream length (default 8x the context)")
    ap.add_argument("--docs", type=int, default=50)
    ap.add_argument("--no-needle", action="store_true", help="perplexity only (a real model's 7K-token needle "
                    "documents cost minutes each on a CPU)")
    ap.add_argument("--poolings", default="mean", help="how a step's mass is pooled over query heads, each patched "
                    "in (bench/importance_reduce.py): mean (the engine's), headmax")
    ap.add_argument("--out", default="docs/importance_score")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    A.setup_torch(1)
    from engine.worker.model_store import resolve_model

    model = str(resolve_model(args.model or "reference", fallback=False))
    ctx = A.trained_context(model)
    real = retention.accumulate_importance
    rows = []
    t0 = time.perf_counter()
    from bench.importance_reduce import ENGINE_ACCUMULATE, REDUCES
    from engine.worker import importance

    for name, pooling in [(r, p) for r in args.rules.split(",") for p in args.poolings.split(",")]:
        retention.accumulate_importance = make_rule(name)
        importance.accumulate = REDUCES[pooling]
        try:
            ppl = eviction.run_budget_long_ppl(model, (25, 50), args.tokens or 8 * ctx, ctx // 8)
            inview = None if args.no_needle else eviction.run_budget_needle(model, (25,), args.docs)
            stream = None if args.no_needle else eviction.run_budget_needle(model, (25,), args.docs, chunk=128)
        finally:
            retention.accumulate_importance = real
            importance.accumulate = ENGINE_ACCUMULATE
        by = {r["arm"]: r for r in ppl.rows}
        rin = {r["arm"]: r for r in inview.rows} if inview else None
        rst = {r["arm"]: r for r in stream.rows} if stream else None
        rows.append({"rule": name, "pooling": pooling, "ppl dense": by["dense"]["ppl"],
                     "ppl 25%": f'{by["importance_25"]["ppl"]} ({by["importance_25"]["vs dense"]})',
                     "ppl 50%": f'{by["importance_50"]["ppl"]} ({by["importance_50"]["vs dense"]})',
                     "ppl window 25%": f'{by["sinks_window_25"]["ppl"]} ({by["sinks_window_25"]["vs dense"]})',
                     "needle 25% in view": f'{rin["importance_25"]["correct"]} (dense {rin["dense"]["correct"]})' if rin else "not run",
                     "needle 25% streamed": f'{rst["importance_25"]["correct"]} (dense {rst["dense"]["correct"]})' if rst else "not run"})
        print(markdown_table(list(rows[-1]), rows[-1:]), flush=True)
    result = EvalResult(name="importance_score", title="Importance eviction: which running score per block",
                        columns=list(rows[0]), rows=rows, panels=[],
                        meta={"model": args.model or "reference", "trained_context": ctx,
                              "tokens": args.tokens or 8 * ctx, "chunk": ctx // 8, "docs": args.docs,
                              "command": "python -m bench.importance_score " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "wall_s": round(time.perf_counter() - t0, 1)},
                        notes=["ppl: held-out corpus stream, chunked prefill, eviction between chunks (question not in "
                               "view); needle in view: one prefill then eviction (kvpress's order); streamed: 128-token chunks"])
    write_report(result, Path(args.out))
    print(markdown_table(result.columns, result.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
