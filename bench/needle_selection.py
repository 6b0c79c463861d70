"""Why does the sparse needle miss a document? Per layer, what dense attention puts on the fact and what the
trained indexer keeps of it (issue 37).

    python -m bench.needle_selection --model smollm2-135m-instruct --docs 0,1 --length 0.5 --denom 8 \
        --out docs/evals/smollm2/needle_selection

For each document of ``sinkserve eval needle --sparse`` (same builder, same seed, filler and length), one
dense forward captures every layer's queries and keys after RoPE. At the last prompt token (the query that
produces the first answer token) it reports, per layer:

- the dense attention mass on the fact's tokens, mean over heads and for the head that puts the most there;
- for that head's heaviest fact token: its weight, and its rank among the candidates the trained indexer
  scores (every visible token outside the forced set: the sink block and the newest ``local_window``);
- whether that token is in the indexer's top-k (``L / denom`` tokens, the eval's budget).

A layer whose heavy fact token is ranked past top-k is where sparse attention cuts the fact off. Only the
last prompt token is read: the question's earlier tokens and the decode steps select too, so a miss can
also start there (this says where the first answer token loses the fact, not every way it can).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from engine.worker.model_store import resolve_model
from engine.limits import derived_local_window
from engine.worker import lightning
from engine.worker.sparse_config import INDEXER_WEIGHTS
from evals import arms as A
from evals.needle import _tokenizer
from evals.sparse import capture_qk, needle_documents

logger = logging.getLogger("needle_selection")


def layer_rows(q: torch.Tensor, k: torch.Tensor, scale: float, ix: lightning.LightningIndexer, layer: int,
               fact: list[int], window: int, top_k: int, block_size: int) -> dict[str, float | int | bool]:
    """One layer at the last query: ``q [Hq, T, D]``, ``k [Hkv, T, D]`` (after RoPE)."""
    t = q.shape[1] - 1
    rep = q.shape[0] // k.shape[0]
    probs = torch.softmax(torch.einsum("hd,htd->ht", q[:, t], k.repeat_interleave(rep, 0)) * scale, -1)  # [Hq, T]
    on_fact = probs[:, fact].sum(-1)
    head = int(on_fact.argmax())
    heavy = fact[int(probs[head, fact].argmax())]
    iq, iw = ix.queries(layer, q[:, t:].transpose(0, 1))
    score = lightning.scores(iq, iw, ix.keys(layer, k.transpose(0, 1)))[0]
    pos = torch.arange(t + 1)
    forced = (pos < block_size) | (pos > t - window)
    score = score.masked_fill(forced, float("-inf"))
    rank = int((score > score[heavy]).sum())
    return {"layer": layer, "fact mass (mean head)": round(float(on_fact.mean()), 4),
            "fact mass (max head)": round(float(on_fact.max()), 4), "head": head,
            "heaviest fact token weight": round(float(probs[head, heavy]), 4), "its indexer rank": rank,
            "candidates": int((~forced).sum()), "in top_k": rank < top_k}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", default="0,1", help="document indices of the needle eval (comma list)")
    ap.add_argument("--length", type=float, default=0.5, help="the eval's --lengths (fraction of the context)")
    ap.add_argument("--denom", type=int, default=8, help="the eval's --sparse budget: top_k = L / denom")
    ap.add_argument("--filler", default="prose")
    ap.add_argument("--heavy", type=float, default=0.1, help="list layers whose max head puts >= this on the fact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="path prefix: writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, fetch=False, fallback=False)
    ctx = A.trained_context(model)
    attended = int(ctx * args.length)
    top_k, window = attended // args.denom, derived_local_window(ctx)
    indices = [int(x) for x in args.docs.split(",")]
    cfg, docs = needle_documents(model, args.length, indices, args.filler)
    tok = _tokenizer(model)
    ix = lightning.LightningIndexer.load(Path(model) / INDEXER_WEIGHTS)
    report: list[dict[str, object]] = []
    lines = [f"# Needle: what the trained indexer keeps of the fact, per layer ({Path(model).name})", "",
             f"`python -m bench.needle_selection --model {args.model} --docs {args.docs} --length {args.length:g} "
             f"--denom {args.denom} --out {args.out}`", "",
             f"Document length {attended - cfg.max_new_tokens - 1} tokens, top_k {top_k} (L/{args.denom}), forced set: "
             f"sink block + newest {window}. At the last prompt token; layers whose max head puts >= {args.heavy:g} "
             "of its attention on the fact.", ""]
    for d in docs:
        enc = tok(d.doc.prompt, return_offsets_mapping=True)
        ids = enc["input_ids"]
        start = d.doc.fact_span[0]
        first = min(i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s and e > start)
        fact = list(range(first, d.fact_last_token + 1))
        rows = [layer_rows(q, k, scale, ix, layer, fact, window, top_k, A.BLOCK_SIZE)
                for layer, (q, k, scale) in enumerate(capture_qk(model, ids))]
        heavy = [r for r in rows if r["fact mass (max head)"] >= args.heavy]
        missed = [r["layer"] for r in heavy if not r["in top_k"]]
        report.append({"doc": d.index, "template": d.doc.template, "answer": d.doc.answer, "tokens": len(ids),
                       "fact_tokens": [first, d.fact_last_token], "layers": rows, "heavy_layers_missed": missed})
        lines += [f"## doc {d.index} ({d.doc.template}, answer {d.doc.answer}, fact tokens {first}..{d.fact_last_token})",
                  "", f"Heavy layers whose heaviest fact token is outside top_k: {missed or 'none'}", "",
                  "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in heavy]
        lines.append("")
        logger.info("doc %d: heavy layers %s, missed %s", d.index, [r["layer"] for r in heavy], missed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines))
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
