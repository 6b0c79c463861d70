"""The text a lightning indexer trains and is checked on (``training/train_indexer.py``).

Two non-overlapping token streams per model:

- the reference model keeps its own corpus (``training.corpus``: its train split to train on, its held-out
  split to check), BOS first and EOS between documents, as it was trained;
- any other model (a real checkpoint such as SmolLM2) reads real English prose the project ships,
  ``evals.long_docs.prose_text()``, tokenized once and cut in two: the first ``1 - HELDOUT_FRACTION`` of the
  tokens to train on, the rest held out, so no held-out token was ever a training token.

Windows follow the tokenizer's own rule (``evals.long_ppl.start_ids``): a tokenizer that adds BOS gets BOS
first in every window; one that adds nothing (SmolLM2) gets raw text windows.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.long_docs import PROSE_HELDOUT_FRACTION
from engine.worker.model_store import REFERENCE_MODEL

logger = logging.getLogger(__name__)

# Share of the prose held out (the tail); one value with ``eval long-ppl --text prose_heldout``.
HELDOUT_FRACTION = PROSE_HELDOUT_FRACTION
# The reference corpus is large; this many tokens of it are plenty for a few thousand windows.
REFERENCE_TRAIN_TOKENS = 400_000


@dataclass(frozen=True)
class IndexerText:
    """Token streams to train on and to check on (disjoint), and what starts a window (``[]`` or ``[BOS]``)."""

    source: str
    train: list[int]
    heldout: list[int]
    start: list[int]


def is_reference(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is the embedded reference model (which keeps its own training corpus)."""
    return Path(model_dir).resolve() == REFERENCE_MODEL.resolve()


def _corpus_stream(tok: Any, split: str, n_tokens: int, seed: int) -> list[int]:
    """Shuffled ``training.corpus`` documents separated by EOS (no BOS: windows add it)."""
    from training.corpus import load_corpus

    docs = load_corpus(split)
    random.Random(seed).shuffle(docs)
    ids: list[int] = []
    for text in docs:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def load_text(model_dir: str | Path, min_heldout: int = 0, seed: int = 0) -> IndexerText:
    """The train and held-out streams for ``model_dir`` (see the module docstring). ``min_heldout``: refuse
    (``ValueError``) when the held-out part is shorter, since the report's windows would overlap training."""
    from transformers import AutoTokenizer

    from evals.long_ppl import start_ids

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    start = start_ids(tok)
    if is_reference(model_dir):
        text = IndexerText("training.corpus (train / heldout splits)",
                           _corpus_stream(tok, "train", REFERENCE_TRAIN_TOKENS, seed),
                           _corpus_stream(tok, "heldout", max(min_heldout, 8 * 1024), seed), start)
    else:
        from app.long_docs import prose_text

        ids = tok(prose_text(), add_special_tokens=False)["input_ids"]
        cut = int(len(ids) * (1 - HELDOUT_FRACTION))
        text = IndexerText(f"pydoc_data.topics prose: first {1 - HELDOUT_FRACTION:.0%} of {len(ids)} tokens train, "
                           f"the last {HELDOUT_FRACTION:.0%} held out", ids[:cut], ids[cut:], start)
    if len(text.heldout) < min_heldout:
        raise ValueError(f"held-out text has {len(text.heldout)} tokens, fewer than the {min_heldout} needed")
    logger.info("indexer text: %s; train %d tokens, held-out %d, window start %s", text.source, len(text.train),
                len(text.heldout), text.start or "none (raw text)")
    return text


def windows(stream: list[int], start: list[int], seq_len: int, batch: int, rng: random.Random) -> torch.Tensor:
    """``[batch, seq_len]`` random windows of ``stream``, each led by ``start`` (BOS or nothing)."""
    body = seq_len - len(start)
    if len(stream) <= body:
        raise ValueError(f"seq_len {seq_len}: the text has only {len(stream)} tokens; lower --seq-len")
    out = []
    for _ in range(batch):
        a = rng.randrange(0, len(stream) - body)
        out.append(start + stream[a : a + body])
    return torch.tensor(out)


def window_positions(ctx: int, seq_len: int, batch: int, rng: random.Random) -> torch.Tensor:
    """``[batch, seq_len]`` position ids: each window at its own offset, drawn uniformly from ``0..ctx-seq_len``,
    so the windows' positions together cover the model's whole trained context.

    Why: the indexer scores the model's post-RoPE queries and keys, so what it learns depends on the absolute
    positions it sees. Trained only at ``0..seq_len-1`` it fits those rotations and fails beyond them (SmolLM2,
    recall at a 1/8 budget vs block_bounds: 0.728 vs 0.717 at 2,048 tokens, 0.476 vs 0.757 at 8,192).

        ctx 8192, seq_len 2048, offsets drawn 0 and 5000:
        window 0:  positions     0 ..  2047
        window 1:  positions  5000 ..  7047   (the tokens are the same kind of text; only RoPE differs)
    """
    if seq_len > ctx:
        raise ValueError(f"seq_len {seq_len} is longer than the trained context {ctx}")
    offsets = torch.tensor([rng.randrange(0, ctx - seq_len + 1) for _ in range(batch)])
    return offsets[:, None] + torch.arange(seq_len)[None, :]


def consecutive_windows(stream: list[int], start: list[int], seq_len: int, count: int) -> torch.Tensor:
    """The first ``count`` consecutive, disjoint ``seq_len`` windows of ``stream`` (held-out checks: fixed)."""
    body = seq_len - len(start)
    if len(stream) < count * body:
        raise ValueError(f"held-out text has {len(stream)} tokens, fewer than {count} windows of {seq_len}")
    return torch.tensor([start + stream[i * body : (i + 1) * body] for i in range(count)])
