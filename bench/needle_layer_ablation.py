"""Which layers' sparse selection loses a needle document? Run it sparse with chosen layers dense (issue 37).

    python -m bench.needle_layer_ablation --model smollm2-135m-instruct --doc 1 --dense-layers ',26,7;17;18;20;23,all' \
        --out docs/evals/smollm2/needle_layer_ablation

One document of ``sinkserve eval needle --sparse`` (same builder, seed, filler and length), through the engine
with the trained indexer at ``L / denom``, once per entry of ``--dense-layers`` (comma-separated entries,
layers inside an entry joined by ``;``; an empty entry = every layer sparse, ``all`` = every layer dense).
The listed layers attend densely (the engine's paged path), all others sparsely. The answer flips back
when the dense layers include the ones whose selection dropped what the answer needs.
``bench/needle_selection.py`` gives candidate layers from one forward; this confirms them in the engine.

The ablation patches ``engine.worker.attention._sparse_forward`` in this process (a diagnostic, not a
setting: the product has one sparse path), and keeps the engine off the C decode step, which selects in C
and would not see the patch: prompt and answer tokens alike go through the patched torch path. Writes
``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from app import long_docs
from engine.worker import attention, decode_path
from engine.worker.model_store import resolve_model
from evals import arms as A
from evals.needle import run_arm
from evals.sparse import needle_documents, sparse_arms

logger = logging.getLogger("needle_layer_ablation")


def parse_entries(spec: str, num_layers: int) -> list[frozenset[int]]:
    """``",26,7;17,all"`` -> ``[{}, {26}, {7, 17}, {0..n-1}]``; an entry given twice runs once (``","`` is
    two empty entries, one arm)."""
    out: list[frozenset[int]] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if entry == "all":
            layers = frozenset(range(num_layers))
        else:
            try:
                layers = frozenset(int(x) for x in entry.split(";") if x.strip())
            except ValueError:
                raise SystemExit(f"--dense-layers: {entry!r} is not ';'-joined layer numbers, '' or 'all'") from None
        bad = sorted(x for x in layers if not 0 <= x < num_layers)
        if bad:
            raise SystemExit(f"--dense-layers: no layer {bad[0]} (the model has {num_layers})")
        if layers not in out:
            out.append(layers)
    return out


def dense_layers_patch(dense: set[int]):  # type: ignore[no-untyped-def]
    """``_sparse_forward`` that sends the layers in ``dense`` (a live set) to the paged dense path."""
    sparse_forward = attention._sparse_forward

    def forward(ctx, layer: int, q: torch.Tensor, kv: object, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if layer in dense:
            cache = ctx.kv_cache
            return cache.paged_attention(ctx.backend, layer, q, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc,
                                         scale, window=None, sinks=None, **ctx.plan_kwargs(None, cache.block_size))
        return sparse_forward(ctx, layer, q, kv, scale)

    return forward


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--doc", type=int, default=1, help="document index of the needle eval")
    ap.add_argument("--dense-layers", default=",all", help="entries: ';'-joined layers, '' (none) or 'all'")
    ap.add_argument("--length", type=float, default=0.5)
    ap.add_argument("--denom", type=int, default=8)
    ap.add_argument("--filler", default="prose")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="path prefix: writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model, fetch=False, fallback=False)
    ctx = A.trained_context(model)
    num_layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    entries = parse_entries(args.dense_layers, num_layers)
    attended = int(ctx * args.length)
    cfg, doc = needle_documents(model, args.length, [args.doc], args.filler)
    arm = sparse_arms(ctx, (args.denom,), ("trained",), attended, only=(f"trained_1/{args.denom}",))[1]
    dense: set[int] = set()
    attention._sparse_forward = dense_layers_patch(dense)
    c_step_blockers = decode_path.c_step_blockers
    decode_path.c_step_blockers = lambda config, facts: [*c_step_blockers(config, facts), "a layer ablation"]
    rows: list[dict[str, Any]] = []
    for layers in entries:
        dense.clear()
        dense.update(layers)
        texts, wall = run_arm(cfg, arm, doc, f"{args.length:g}x", progress=False)
        ok = long_docs.check_answer(texts[0], doc[0].doc.answer)
        label = "all" if len(layers) == num_layers else (", ".join(map(str, sorted(layers))) or "none")
        rows.append({"dense layers": label, "answer": texts[0][:24], "correct": ok, "wall_s": round(wall, 1)})
        logger.info("dense layers %s: %r correct=%s (%.0fs)", label, texts[0], ok, wall)
    cmd = (f"python -m bench.needle_layer_ablation --model {args.model} --doc {args.doc} --dense-layers "
           f"'{args.dense_layers}' --length {args.length:g} --denom {args.denom} --out {args.out}")
    lines = [f"# Needle doc {args.doc}: trained 1/{args.denom} sparse attention with chosen layers dense", "", f"`{cmd}`",
             "", f"Document {args.doc} ({doc[0].doc.template}, answer {doc[0].doc.answer}), {doc[0].n_tokens} tokens, "
             f"top_k {arm.sparse.top_k}. The listed layers attend densely, the other {num_layers} minus them sparsely.", "",
             "| dense layers | answer | correct | wall s |", "|---|---|---|---|"]
    lines += [f"| {r['dense layers']} | {r['answer']!r} | {r['correct']} | {r['wall_s']} |" for r in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"doc": args.doc, "answer": doc[0].doc.answer, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
