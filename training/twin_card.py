"""The model cards of the Attention-Residuals twins (docs/attnres.md, issue 41), from what their training and
the twins-copy report recorded.

    python -m training.twin_card --twins assets/twin-standard,assets/twin-attnres \\
        --report docs/attnres/twins_copy.json

For each twin directory writes ``README.md`` (shape, training, its copy gain at every point, the gate and the
verdict) and ``eval_results.json`` (the same figures), then rewrites its ``SHA256SUMS`` (the weights may have
changed). Reads ``training_meta.json`` and ``config.json`` beside the weights and the ``sinkserve eval
twins-copy`` result JSON; runs no model.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from training.model_card import schedule_text

logger = logging.getLogger(__name__)

# The twins-copy report's column holding each twin's copy, by architecture.
COPY_COLUMN = {"llama": "standard copy", "attnres": "AttnRes copy"}


def _shape_lines(cfg: dict[str, Any], arch: str) -> list[str]:
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    blocks = cfg.get("attn_res_num_blocks") or cfg["num_hidden_layers"]
    # Each layer is two sub-layers (attention, MLP) that the depth-wise attention mixes over.
    first = ("- `AttnResForCausalLM` (Attention Residuals, `engine.attnres`, "
             f"{blocks} blocks of {2 * cfg['num_hidden_layers'] // blocks} sub-layers; load with `import engine.attnres` then "
             "`AutoModelForCausalLM.from_pretrained`)" if arch == "attnres"
             else "- `LlamaForCausalLM` (standard pre-norm residual stream)")
    return [first,
            f"- {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP {cfg['intermediate_size']}, "
            f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads, RoPE theta {rope:g}, "
            f"{'tied' if cfg.get('tie_word_embeddings') else 'untied'} embeddings",
            f"- trained context `max_position_embeddings: {cfg['max_position_embeddings']}`",
            "- tokenizer, chat template: the reference model's (assets/reference-model; byte-level BPE, 4,096 ids)"]


def render(model_dir: Path, report: dict[str, Any], report_path: str) -> tuple[str, dict[str, Any]]:
    """``(README text, eval_results dict)`` of one twin."""
    meta = json.loads((model_dir / "training_meta.json").read_text())
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = meta["arch"]
    name = model_dir.name
    column = COPY_COLUMN[arch]
    points = [{"kind": r["kind"], "point": r["point"], "L": r["L"], "copy": r[column]} for r in report["rows"]]
    gate, verdict = report["meta"]["gate"], report["meta"]["verdict"]
    role = ("The AttnRes twin" if arch == "attnres" else "The standard twin")
    lr_seqs = meta.get("longrange_seqs") or {}
    lines = [
        f"# sinkserve {name.replace('-', ' ')} (issue 41)", "",
        f"{role} of docs/attnres.md (issue 41): a {meta['params'] / 1e6:.2f}M-parameter causal LM trained from scratch "
        "on a 2-core CPU on a corpus whose sequences repeat spans at long distances (training/longrange_docs.py), so "
        "that it learns to copy (induction). It and its twin saw the same batches in the same order for the same "
        "number of steps; they differ only in the residual stream. A test model for the first-last consistency "
        "comparison, not a useful assistant.", "",
        "## Shape", "", *_shape_lines(cfg, arch), "",
        "## Training", "",
        f"- {meta['steps']} optimizer steps, {meta['tokens'] / 1e6:.2f}M tokens, {meta['train_seconds'] / 60:.1f} min "
        f"of training wall time, final training loss (EMA) {meta['final_loss_ema']}",
        f"- sequence mix: {meta['longrange_frac']:.0%} long-range sequences (`--longrange-mix {meta['longrange_mix']}`: "
        "random spans repeated across the sequence, an instruction restated and obeyed at the end, key-value "
        f"lookups; counts {lr_seqs}), the rest Python stdlib text",
        f"- curriculum {meta['curriculum']}; AdamW, peak LR {meta['lr']}, {schedule_text(meta)}, seed {meta['seed']}, "
        f"init std {meta.get('init_std', 0.02)}, {meta['threads']} thread{'s' if meta['threads'] > 1 else ''}, float32",
        f"- loss curve: docs/attnres/train-{'attnres' if arch == 'attnres' else 'standard'}/loss_curve.{{jsonl,png}}",
        f"- command: `{meta['command']}`", "",
        f"## Copy gain ({report_path.replace('.json', '.md')})", "",
        "copy = NLL(2nd occurrence | a decoy at the start) - NLL(2nd occurrence), nats/token, mean [95 % CI], "
        f"{report['rows'][0]['n']} samples:", "",
        "| kind | point | copy |", "|---|---|---|",
        *[f"| {p['kind']} | {p['point']} | {p['copy']} |" for p in points], "",
        f"Gate: {gate}", "", f"Verdict (AttnRes vs standard): {verdict}", "",
        "## License", "",
        "Trained on the Python standard library's sources and docs (PSF License 2.0); weights under the "
        "repository's license.", ""]
    return "\n".join(lines), {"copy_gain": points, "gate": gate, "verdict": verdict, "source": report_path}


def main(argv: list[str] | None = None) -> None:
    """Write both twins' cards and manifests."""
    from engine.worker import weights as W

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--twins", required=True, help="comma-separated twin model directories")
    ap.add_argument("--report", required=True, help="`sinkserve eval twins-copy` result JSON (twins_copy.json)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = json.loads(Path(args.report).read_text())
    for d in (Path(x) for x in args.twins.split(",")):
        text, results = render(d, report, args.report)
        (d / "README.md").write_text(text)
        (d / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
        W.write_manifest(d)
        logger.info("wrote %s/README.md, eval_results.json, SHA256SUMS", d)


if __name__ == "__main__":
    main()
