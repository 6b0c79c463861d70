"""Is a trained lightning indexer still a good ranker past the positions it trained on?

``train-indexer`` trains on windows of ``--seq-len`` tokens (default 2,048 for SmolLM2), always starting at
position 0, while the engine asks it to rank keys anywhere in the trained context (8,192). Its scores are
taken on post-RoPE queries and keys, and its projections mix rotary channels, so a score depends on the
absolute positions, not only on the distance (docs/evals/smollm2/indexer.md). This measures the recall of
the attention mass outside the forced set (``evals.sparse.attention_recall``, int8 index keys as in the
engine) on held-out windows of growing length, each with a 1/8 budget, beside block_bounds (no learned
parameters), random and the block oracle::

    .venv/bin/python -m bench.indexer_recall_by_length --model smollm2-135m-instruct \
        --lengths 2048,4096,8192 --out docs/evals/smollm2

Queries: positions L/4 .. L, every 8th; forced set: the sink block + the engine's local window (the
trained context's, at every length).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

logger = logging.getLogger("bench.indexer_recall_by_length")

ARMS = ("trained", "block_bounds", "random", "oracle")


def recall_at(model: str, ids: list[int], length: int, docs: int) -> dict[str, float]:
    """Mean 'beyond forced' recall per arm over ``docs`` windows of ``length`` tokens and all layers, at a
    ``length / 8`` budget (``evals.sparse.run_recall``'s per-layer rows, averaged)."""
    from evals.sparse import run_recall

    rows = run_recall(model, (8,), docs, ids=ids, length=length).rows
    return {arm: float(np.mean([r[f"{arm} beyond forced"] for r in rows])) for arm in ARMS}


def main(argv: list[str] | None = None) -> int:
    from engine.worker.model_store import resolve_model
    from evals.arms import trained_context
    from evals.long_ppl import heldout_stream
    from evals.report import EvalResult, Panel, Series, write_report
    from engine.limits import derived_local_window
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model name or directory with indexer.safetensors")
    ap.add_argument("--lengths", default="2048,4096,8192", help="window lengths (tokens), comma-separated")
    ap.add_argument("--docs", type=int, default=2, help="held-out windows per length")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "evals" / "smollm2")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, fetch=False, fallback=False)
    lengths = [int(x) for x in args.lengths.split(",")]
    window = derived_local_window(trained_context(model))  # run_recall's forced window, for the notes
    tok = AutoTokenizer.from_pretrained(model)
    ids = heldout_stream(tok, args.docs * max(lengths), "prose_heldout")
    t0 = time.perf_counter()
    rows = []
    for length in lengths:
        r = recall_at(model, ids, length, args.docs)
        logger.info("length %d: %s", length, {k: round(v, 3) for k, v in r.items()})
        rows.append({"window tokens": length, "budget (tokens)": length // 8,
                     **{arm: round(r[arm], 3) for arm in ARMS},
                     "trained - block_bounds": round(r["trained"] - r["block_bounds"], 3)})
    result = EvalResult(
        name="indexer_recall_by_length", title="Trained indexer recall by window length (1/8 budget)",
        columns=["window tokens", "budget (tokens)", *ARMS, "trained - block_bounds"], rows=rows,
        panels=[Panel("recall of the attention mass outside the forced set", "window tokens",
                      "share of the non-forced mass attended",
                      [Series(arm, [float(x["window tokens"]) for x in rows], [x[arm] for x in rows], "-o")
                       for arm in ARMS], logx=True, ylim=(0, 1.02))],
        notes=[f"held-out prose (prose_heldout), {args.docs} windows per length, queries L/4..L every 8th, all layers "
               f"averaged; forced set = sink block + newest {window} tokens; budget L/8 tokens beyond it",
               "the indexer trained on windows starting at position 0 (its --seq-len): rows longer than that ask it "
               "to rank at positions and distances it never saw"],
        meta={"model": model, "wall_s": round(time.perf_counter() - t0, 1),
              "command": "python -m bench.indexer_recall_by_length " + " ".join(sys.argv[1:] if argv is None else argv)})
    for path in write_report(result, args.out).values():
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
