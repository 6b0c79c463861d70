"""What a lightning-indexer training run reports (``training/train_indexer.py``): its card (the model card's
indexer section, ``<model>/indexer_card.md``), its loss curve, and the per-layer recall against the
block_bounds selector and a random selection on held-out windows (``evals.sparse.run_recall``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from evals.report import EvalResult, Panel, Series

if TYPE_CHECKING:
    from training.train_indexer import TrainResult

logger = logging.getLogger(__name__)

CARD_NAME = "indexer_card.md"


def render_card(weights: Path) -> str:
    """The indexer's section of the model card, from the metadata ``train`` stored in the weights file."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        meta = f.metadata()
        n_params = sum(f.get_tensor(k).numel() for k in f.keys())
    res = json.loads(meta["heldout"])
    ks = sorted(res["recall"], key=int)
    layers = len(res["kl"])
    minutes = int(meta["wall_s"]) / 60
    lines = [
        "### Lightning indexer (`indexer.safetensors`)", "",
        f"A trained indexer for `sparse: {{indexer: trained}}` (`engine/worker/lightning.py`, DeepSeek-V3.2's DSA indexer): "
        f"per layer {meta['heads']} heads x {meta['dim']} dims reading the layer's own query and key (after RoPE); "
        "`score[t, p] = sum_h w[t, h] relu(qi[t, h] . ki[p])` with `qi = Wq q`, `w = Ww q` (weights from the query "
        f"side), `ki = Wk k`; {n_params:,} parameters ({weights.stat().st_size // 1024} KiB, float32), index keys "
        f"cached as int8 + one fp32 scale per token ({int(meta['dim']) + 4} bytes per token and layer).", "",
        f"Trained with the model frozen (`sinkserve model train-indexer`, {meta['steps']} steps of {meta['batch']} x "
        f"{meta['seq_len']}-token windows of {meta.get('text', 'the model training corpus')}, {minutes:.1f} min on the "
        f"shared 2-core CPU with {meta.get('threads', '1')} thread(s)): KL from the model's "
        + ("attention of the most attending head per position (`--target max`; renormalised)"
           if meta.get("target") == "max" else "head-averaged attention")
        + " to `softmax(score)`, both over the *candidate* positions (outside the forced set the engine always attends: the "
        f"first {meta['sink_tokens']} tokens and the newest {meta['local_window']}), summed over layers (final EMA "
        f"{meta['final_kl_ema']}; held-out sum {sum(res['kl']):.3f})."
        + (f" Started from `{meta['init']}`." if meta.get("init") else "")
        + (f" {meta['revived_this_run']} dead heads revived by a sign flip (`--revive-below "
           f"{meta['revive_below']}`)." if meta.get("revived_this_run", "0") != "0" else "")
        + (f" Only layers {meta['layers_trained']} trained this run (`--layers`); the others are `--init`'s."
           if meta.get("layers_trained") and meta["layers_trained"] != ",".join(map(str, range(len(res["kl"]))))
           else "")
        + (" Their held-out figures are copied from `--init`'s record (same held-out key: model, text, windows "
           "and forced set; weights unchanged), not recomputed." if meta.get("heldout_copied_from_init") else ""), "",
        f"Held-out ({meta.get('heldout_windows', '2')} windows of {meta['seq_len']} tokens, every query with more than "
        "top_k candidates; KL and recall against the head-averaged attention whatever the training target): share "
        "of the candidates' attention mass held by the top_k candidates the indexer ranks "
        "first, vs the oracle (the top_k heaviest). Heads alive: heads whose ReLU passes at least 1 % of the "
        "(query, candidate) pairs; a dead head scores every candidate 0 (the shares per head in brackets).", "",
        "| layer | KL | heads alive | " + " | ".join(f"top_k {k}: indexer / oracle" for k in ks) + " |",
        "|---|---|---|" + "---|" * len(ks),
    ]
    alive = res.get("alive") or [[] for _ in range(layers)]  # cards of indexers trained before it was measured
    for li in range(layers):
        cells = [f"{res['recall'][k][li]:.2f} / {res['oracle'][k][li]:.2f}" for k in ks]
        heads = (f"{sum(a >= 0.01 for a in alive[li])}/{len(alive[li])} ("
                 + ", ".join(f"{a:.2f}" for a in alive[li]) + ")") if alive[li] else "-"
        lines.append(f"| {li} | {res['kl'][li]:.3f} | {heads} | " + " | ".join(cells) + " |")
    lines += ["", "Engine-level figures (forced set + selection, both indexers, needle and perplexity at 1/8 and 1/16 "
              "budgets): `docs/sparse_attention.md`, `docs/evals/sparse_recall.md`."]
    return "\n".join(lines) + "\n"


def write_card(model_dir: Path, weights: Path, out: Path | None = None) -> Path:
    """Write the card to ``out`` (default ``<model>/indexer_card.md``, which ``training/model_card.py``
    includes in the model card); returns its path."""
    path = out or Path(model_dir) / CARD_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_card(weights))
    return path


def curve_result(curve: list[dict[str, float]], meta: dict[str, object]) -> EvalResult:
    """The loss curve as an ``EvalResult`` (md + json + png through ``write_report``): every 10th step in
    the table, every step in the plot."""
    rows = [r for r in curve if r["step"] % 10 == 0 or r is curve[-1]]
    panel = Panel("KL (sum over layers) per step", "step", "KL, nats", [
        Series("step", [r["step"] for r in curve], [r["kl"] for r in curve], "-"),
        Series("EMA", [r["step"] for r in curve], [r["ema"] for r in curve], "-")])
    return EvalResult(name="indexer_training", title="Lightning indexer training: loss curve",
                      columns=["step", "kl", "ema", "lr", "wall_s"], rows=rows, panels=[panel], meta=meta)


def write_reports(model_dir: str, result: TrainResult, out_dir: Path, recall_docs: int, command: str) -> list[Path]:
    """Under ``out_dir``: ``indexer_card.md``, ``indexer_training.{md,json,png}`` (the loss curve) and
    ``indexer_recall.{md,json,png}`` (per layer: trained vs block_bounds vs random at ctx/8 and ctx/16, on
    ``recall_docs`` held-out windows of the trained context); returns the paths written."""
    from engine.limits import read_model_config, trained_context
    from evals.report import write_report
    from evals.sparse import run_recall
    from training import indexer_checkpoint as ckpt
    from training.indexer_data import load_text

    meta = {"model": model_dir, "command": f"sinkserve {command}", "steps": result.step,
            "training_minutes": round(result.wall_s / 60, 1), "seq_len": result.seq_len,
            "forced": f"sink {result.forced.sink_tokens} + local window {result.forced.local_window} tokens",
            "heldout_kl_sum": round(sum(result.heldout["kl"]), 4)}
    paths = [write_card(Path(model_dir), result.out, out_dir / CARD_NAME)]
    paths += list(write_report(curve_result(ckpt.read_curve(result.out), meta), out_dir).values())
    ctx = trained_context(read_model_config(model_dir))
    text = load_text(model_dir, min_heldout=recall_docs * ctx)
    recall = run_recall(model_dir, (8, 16), recall_docs, ids=text.heldout, start=text.start,
                        local_window=result.forced.local_window, indexer_path=result.out)
    recall.name = "indexer_recall"
    recall.meta.update({"command": meta["command"], "text": text.source, "training_minutes": meta["training_minutes"]})
    paths += list(write_report(recall, out_dir).values())
    return paths
