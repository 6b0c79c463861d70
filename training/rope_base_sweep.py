"""Choose a RoPE base for a trained model without touching the held-out evaluation set.

    python -m training.rope_base_sweep --model assets/reference-model --thetas 10000,20000,30000,50000 \
        --out docs/rope_base_sweep.md

For each base the model's weights are loaded unchanged with ``rope_theta`` replaced, then scored
without the held-out set: perplexity at 1,024 tokens on windows of the training corpus, and pass-key /
fact retrieval at 512 and 1,000 tokens with ``VALIDATION_TEMPLATES`` (never trained on) over the
training fillers. The training templates themselves are no use here: the model retrieves them at
95-100% at 1,000 tokens whatever the base. The model card's figures use the held-out templates,
fillers and corpus, which this sweep never reads, so a base picked here is not tuned on the numbers it
is later reported with.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from app import long_docs
from training import model_card
from training.corpus import load_corpus
from training.train_reference_model import load_init_model

logger = logging.getLogger("rope_base_sweep")

# Far from the seeds the training sampler draws (< 10^6 per run), so these documents are new.
SEED0 = 7_000_000


def train_stream(tok, max_docs: int = 400) -> list[int]:
    """Token stream of the training split's first documents (the card reads the held-out split).

    Also registers the ``corpus`` filler the training templates use, as the training sampler does.
    """
    docs = load_corpus("train")
    long_docs.register_filler("corpus", long_docs.TextFiller(docs))
    return model_card.docs_stream(tok, docs[:max_docs])


def score(model_dir: str, theta: float, tok, stream: list[int], n_docs: int, ppl_windows: int) -> dict:
    """Perplexity at 1,024 and retrieval at 512 / 1,000 tokens with validation templates, for one base."""
    model = load_init_model(model_dir, rope_theta=theta).eval()
    wins = model_card.windows(stream, tok.bos_token_id, 1024, ppl_windows)
    row = {"theta": theta, "ppl@1024": model_card.perplexity(model, wins)}
    results, _ = model_card.retrieval(model, tok, lengths=(512, 1000), n_docs=n_docs,
                                      templates=long_docs.VALIDATION_TEMPLATES, fillers=long_docs.TRAIN_FILLERS,
                                      seed0=SEED0)
    row.update({k: v["accuracy"] for k, v in results.items()})
    return row


def render(rows: list[dict], model_dir: str, n_docs: int, ppl_windows: int) -> str:
    keys = ["ppl@1024", "passkey@512", "passkey@1000", "fact@512", "fact@1000"]
    lines = [f"RoPE base sweep of `{model_dir}` (weights unchanged; validation templates over "
             f"training fillers, training corpus for perplexity; "
             f"{n_docs} documents per retrieval point, {ppl_windows} windows of 1,024 tokens for perplexity).", "",
             "| rope_theta | " + " | ".join(keys) + " |", "| ---: | " + " | ".join("---:" for _ in keys) + " |"]
    for r in rows:
        cells = [f"{r[k]:.2f}" if k.startswith("ppl") else f"{100 * r[k]:.0f}%" for k in keys]
        lines.append(f"| {r['theta']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="assets/reference-model")
    ap.add_argument("--thetas", default="10000,20000,30000,50000",
                    help="comma-separated RoPE bases to score")
    ap.add_argument("--docs", type=int, default=60, help="documents per retrieval point and kind")
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)

    tok, _ = model_card.load(args.model)
    stream = train_stream(tok)
    rows = []
    for theta in (float(t) for t in args.thetas.split(",")):
        rows.append(score(args.model, theta, tok, stream, args.docs, args.ppl_windows))
        logger.info("theta %g: %s", theta, rows[-1])
    table = render(rows, args.model, args.docs, args.ppl_windows)
    if args.out:
        Path(args.out).write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
