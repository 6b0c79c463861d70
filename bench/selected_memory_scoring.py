"""Selected memory's indexer: position-free scoring (the product) vs scoring at the stored positions (the loser).

    nice -n 10 .venv/bin/python bench/selected_memory_scoring.py [--docs 20] [--mult 16]

Same needle documents and arm as ``sinkserve eval needle --selected-memory`` (evals/selected_memory.py). The
"stored" variant keeps post-RoPE key bounds and scores with the query at its true position (what Quest does
inside the context); attention is re-positioned in both. Swapped in by patching ``StepContext`` for this
process only. Writes ``docs/selected_memory_scoring.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.worker import selected_memory as sm  # noqa: E402
from evals import arms as A  # noqa: E402
from app import long_docs  # noqa: E402
from evals import selected_memory as esm  # noqa: E402


class StoredPositions(sm.StepContext):
    """Bounds of the keys as stored, queries at their own positions (canonical distance = identity)."""

    def bounds_keys(self, k, layer):  # type: ignore[no-untyped-def]
        return k


def main() -> int:
    from evals.needle import NeedleConfig, _tokenizer, build_docs, run_arm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=20)
    p.add_argument("--mult", type=float, default=16.0)
    p.add_argument("--model", default=A.default_model())
    args = p.parse_args()
    A.setup_torch(1)
    ctx = A.trained_context(args.model)
    cfg = NeedleConfig(model=args.model, lengths=(args.mult,), docs=args.docs, window=ctx // 2, chunk=128)
    docs = build_docs(_tokenizer(args.model), cfg, int(args.mult * ctx) - cfg.max_new_tokens)
    rows = []
    real_ctx, real_canon = sm.StepContext, sm.canonical_queries
    for name in ("position-free (product)", "stored positions"):
        if name.startswith("stored"):
            import engine.worker.model_runner as mr

            mr.selected_memory = type("M", (), {"StepContext": StoredPositions})  # the runner builds this one
            sm.canonical_queries = lambda q, q_pos, distance, inv_freq: q  # noqa: E731
        texts, wall = run_arm(cfg, esm.selected_arm(), docs, f"{args.mult:g}x", progress=False)
        ok = sum(long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, docs))
        rows.append((name, ok, wall))
        print(name, ok, len(docs), round(wall, 1), flush=True)
    sm.StepContext, sm.canonical_queries = real_ctx, real_canon
    lines = ["# Selected memory: position-free vs stored-position block scoring", "",
             f"- command: `python bench/selected_memory_scoring.py {' '.join(sys.argv[1:])}`",
             f"- {args.docs} needle documents at {args.mult:g}x the trained context, arm {dataclasses.asdict(esm.settings())}",
             f"- 1 run, load {[round(x, 2) for x in os.getloadavg()]}", "",
             "| scoring | correct | wall s |", "|---|---|---|",
             *(f"| {n} | {ok}/{args.docs} | {w:.0f} |" for n, ok, w in rows), ""]
    Path(REPO / "docs" / "selected_memory_scoring.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
