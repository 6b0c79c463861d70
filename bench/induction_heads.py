"""Which heads of a trained model form the two halves of an induction circuit? (issue 41 diagnosis)

    python -m bench.induction_heads --models assets/twin-standard,assets/twin-attnres --out docs/attnres/induction_heads

Input: ``BOS R R`` with ``R`` random token ids (``--span`` of them, ``--rows`` rows). Per layer and head,
from the eager attention probabilities:

- previous-token score: mean attention from position ``t`` to ``t-1`` (every ``t >= 2``);
- induction score: mean attention from a position ``t`` of the second ``R`` to ``t - span + 1``, the token
  after the same token's first occurrence (what a copying head looks at)::

      BOS  r1 r2 r3 ... rn  r1 r2 r3 ... rn
                ^              ^
                |______________|  the head at the 2nd r2 attends the 1st r3: induction

A model copies when some head's induction score is high (the reference model's best 0.87, the standard
twin's 0.68, docs/attnres/induction_heads.md); a previous-token head (score near 1) is the half it needs in an earlier layer. Writes a
table (``<out>.md``, ``.json``) and a heat map (``.png``).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def repeated_rows(rows: int, span: int, seed: int, vocab: int, bos: int) -> torch.Tensor:
    """``BOS R R`` per row, ``R`` = ``span`` ids drawn from ``[10, vocab)`` (clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(10, vocab, (rows, span), generator=g)
    return torch.cat([torch.full((rows, 1), bos), r, r], 1)


def head_scores(model_dir: str, span: int, rows: int, seed: int) -> dict[str, list[list[float]]]:
    """``{"previous": [layer][head], "induction": [layer][head]}`` for one model."""
    import engine.attnres  # noqa: F401  an AttnRes directory loads as AttnRes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = repeated_rows(rows, span, seed, model.config.vocab_size, model.config.bos_token_id or 0)
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    t = torch.arange(2, ids.shape[1])
    t2 = torch.arange(span + 1, 2 * span + 1)
    return {"previous": [a[:, :, t, t - 1].mean((0, 2)).tolist() for a in attentions],
            "induction": [a[:, :, t2, t2 - span + 1].mean((0, 2)).tolist() for a in attentions]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", required=True, help="comma-separated model directories")
    ap.add_argument("--span", type=int, default=100)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output stem: <out>.md, <out>.json, <out>.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    models = args.models.split(",")
    res = {m: head_scores(m, args.span, args.rows, args.seed) for m in models}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "scores": res}, indent=1) + "\n")
    lines = [f"# Induction circuit per head: `BOS R R`, {args.rows} rows of {args.span} random ids", "",
             f"`python -m bench.induction_heads --models {args.models} --out {args.out}`", "",
             "| model | layer | previous-token score per head | induction score per head |", "|---|---|---|---|"]
    for m, sc in res.items():
        for li, (p, i) in enumerate(zip(sc["previous"], sc["induction"])):
            lines.append(f"| {m} | {li} | " + ", ".join(f"{x:.2f}" for x in p) + " | "
                         + ", ".join(f"{x:.2f}" for x in i) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(models), figsize=(3.2 * len(models), 5), squeeze=False)
    for c, m in enumerate(models):
        for r, kind in enumerate(("previous", "induction")):
            ax = axes[r][c]
            im = ax.imshow(res[m][kind], vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"{Path(m).name}: {kind}", fontsize=9)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.savefig(out.with_suffix(".png"), dpi=100)
    logger.info("wrote %s.{md,json,png}", out)


if __name__ == "__main__":
    main()
