"""How the importance score pools attention over heads: the question-in-view needle at a fixed budget.

``engine/worker/importance.py`` scores a block by the attention mass the step's last 32 queries put on it,
*averaged* over query heads and summed over layers. A paged cache evicts one block for every layer and
head at once, so a block that a few retrieval heads need and the rest ignore is diluted by the average.
This bench answers the same documents as ``bench/kvpress_compare.py`` (``evals.eviction.budget_docs``:
held-out facts in real prose, the question in view when blocks are scored) with the importance arm under
each pooling, one run, and writes a table::

    mean      mass averaged over the query heads (the engine's rule before this A/B)
    headmax   per layer, the largest mass any query head puts on the block (queries averaged; the
              engine's rule since: engine/worker/importance.py)

    python -m bench.importance_reduce --model smollm2-135m-instruct --docs 12 --doc-tokens 2048 \
        --filler prose --budget 25 --reduce mean,headmax --out docs/importance_reduce.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app import long_docs  # noqa: E402
from bench.report import emit  # noqa: E402
from engine.worker import importance  # noqa: E402
from sinkserve_kernels.block_sparse import gather_blocks  # noqa: E402

ENGINE_ACCUMULATE = importance.accumulate


def mean_accumulate(acc: torch.Tensor, q: torch.Tensor, kv: object, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, block_size: int) -> None:
    """The rule the engine used before (the lost side of this A/B): each block's mass averaged over the
    query heads, added to the layer's row (``importance.accumulate`` takes the max over heads)."""
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        n_q = starts[i + 1] - starts[i]
        if n_q == 0:
            continue
        nb = -(-seq_len // block_size)
        row = block_tables[i, :nb]
        held = (row != 0).nonzero().flatten()
        if held.numel() == 0:
            continue
        keys, _ = gather_blocks(kv, row.index_select(0, held).long(), torch.float32)
        m, bs, hkv, d = keys.shape
        keys = keys.reshape(m * bs, hkv, d)
        pos = (held[:, None] * block_size + torch.arange(bs)).flatten()
        obs = min(n_q, importance.OBSERVATION_QUERIES)
        qs = q[starts[i + 1] - obs : starts[i + 1]].float().view(obs, hkv, -1, d)
        logits = torch.einsum("ohgd,khd->hgok", qs, keys) * scale
        qpos = seq_len - obs + torch.arange(obs)
        logits.masked_fill_((pos[None, :] > qpos[:, None]) | (pos[None, :] >= seq_len), float("-inf"))
        acc[i].index_add_(0, held, logits.softmax(-1).mean(dim=(0, 1, 2)).view(m, bs).sum(1))


REDUCES = {"mean": mean_accumulate, "headmax": ENGINE_ACCUMULATE}  # headmax: the engine's rule since this A/B


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--filler", default="prose", help="prose, licenses, haystack; held-out: the held-out fillers in turn")
    ap.add_argument("--budget", type=int, default=25, help="kept tokens, percent of the document")
    ap.add_argument("--reduce", default="mean,headmax")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk (tokens): the question-not-in-view case, evicting while the document streams "
                         "in; default: one prefill to the last few tokens (the question in view)")
    ap.add_argument("--dense", action="store_true", help="also answer densely (the reference rate)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--append", action="store_true", help="add this run's table below --out's")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from evals import arms as A
    from evals import eviction
    from evals.needle import run_arm
    from engine.worker.model_store import resolve_model

    model = str(resolve_model(args.model))

    t0 = time.time()
    filler = None if args.filler == "held-out" else args.filler
    cfg, docs, doc_tokens = eviction.budget_docs(model, args.docs, args.doc_tokens, filler=filler)
    cfg = dataclasses.replace(cfg, model=model, chunk=args.chunk or min(d.n_tokens for d in docs) - 1, max_num_seqs=1)
    arms = {a.name: a for a in eviction.budget_arms(doc_tokens, (args.budget,))}
    runs = [("dense", "-", arms[A.DENSE.name])] if args.dense else []
    runs += [(f"importance {args.budget}%", r, arms[f"importance_{args.budget}"]) for r in args.reduce.split(",")]
    rows = []
    for label, reduce, arm in runs:
        importance.accumulate = REDUCES.get(reduce, ENGINE_ACCUMULATE)
        texts, wall = run_arm(cfg, arm, docs, "1x", progress=False)
        ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, docs)]
        rows.append((label, reduce, sum(ok), len(ok), wall, os.getloadavg()[0]))
    importance.accumulate = ENGINE_ACCUMULATE
    lines = [
        "# Importance eviction: pooling the attention mass over heads",
        "",
        f"`python -m bench.importance_reduce {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {time.time() - t0:.0f} s; {args.threads} thread(s).",
        "",
        f"Model `{args.model}`, {len(docs)} held-out fact documents of {doc_tokens} tokens in `{args.filler}` filler "
        f"(the documents of `bench/kvpress_compare.py`), "
        + (f"prefilled in chunks of {args.chunk} tokens, evicting to {args.budget} % as the document streams in "
           f"(the question not in view when most blocks are scored)" if args.chunk else
           f"one prefill to the last few tokens, then eviction to {args.budget} % before the question's last tokens "
           f"and the answer (the question in view)")
        + f" (sinks 0..3, a {eviction.LOCAL_WINDOW}-token "
        f"window, block size {A.BLOCK_SIZE}).",
        "",
        "| arm | pooling over heads | correct | rate | wall s | load |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {a} | {r} | {c}/{n} | {c / n:.3f} | {w:.0f} | {ld:.1f} |" for a, r, c, n, w, ld in rows]
    text = "\n".join(lines) + "\n"
    if args.append and args.out and args.out.exists():  # one doc, several settings: later runs go below
        args.out.write_text(args.out.read_text() + "\n" + text.replace("# Importance eviction", "## Importance eviction", 1))
        print(text)
        return 0
    return emit(text, args.out)


if __name__ == "__main__":
    sys.exit(main())
