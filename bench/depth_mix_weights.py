"""What each AttnRes depth mix reads, beside the standard twin's residual stream (issue 41 diagnosis).

    python -m bench.depth_mix_weights --attnres assets/twin-attnres,/path/to/full-twin \
        --standard assets/twin-standard --out docs/attnres/depth_mix_weights

Input: ``BOS R R`` (``--rows`` rows of ``--span`` random ids), the input of ``bench/induction_heads.py``. For every
depth mix of an AttnRes model (each sub-layer's and the final one), averaged over tokens:

- ``weight``: the softmax weight ``a_i`` of each source (``v_0`` = the embedding, then block sums or
  sub-layer outputs, then the running sum of the current block where there is one);
- ``|v|``: each source's mean L2 norm;
- ``share``: ``a_i |v_i| / sum_j a_j |v_j|``, how much of the mixed vector's length each source makes
  (the mix is convex in the weights but not in the norms: a source whose norm grew dominates at any weight).

For the standard twin, the norm of the embedding and of each layer's output (attention + MLP), i.e. what
the unit-weight residual sum adds at each depth. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

from bench.induction_heads import repeated_rows

logger = logging.getLogger(__name__)


@torch.inference_mode()
def attnres_mixes(model_dir: str, ids: torch.Tensor) -> list[dict[str, Any]]:
    """One row per depth mix: its name and each source's weight, norm and share (means over tokens)."""
    from engine.attnres.modeling import AttnResForCausalLM

    model = AttnResForCausalLM.from_pretrained(model_dir).eval()
    rows: list[dict[str, Any]] = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(mod, args, out) -> None:  # type: ignore[no-untyped-def]
            values, inv_rms = args
            weights = torch.softmax((values @ mod.query).float() * inv_rms, 0)  # [n, B, T]
            norms = values.float().norm(dim=-1)
            part = weights * norms
            rows.append({"mix": name, "weight": [round(float(x), 3) for x in weights.mean((1, 2))],
                         "|v|": [round(float(x), 2) for x in norms.mean((1, 2))],
                         "share": [round(float(x), 3) for x in (part / part.sum(0)).mean((1, 2))],
                         "query norm": round(float(mod.query.norm()), 2)})
        return record

    for i, layer in enumerate(model.model.layers):
        layer.attn_mix.register_forward_hook(hook(f"layer {i} attention"))
        layer.mlp_mix.register_forward_hook(hook(f"layer {i} MLP"))
    model.model.final_mix.register_forward_hook(hook("final"))
    model(ids)
    return rows


@torch.inference_mode()
def standard_stream(model_dir: str, ids: torch.Tensor) -> list[dict[str, Any]]:
    """The embedding's norm and each layer's output norm (mean over tokens) in a standard-residual model."""
    from transformers import AutoModelForCausalLM

    hs = AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids, output_hidden_states=True).hidden_states
    rows = [{"term": "embedding", "|term|": round(float(hs[0].norm(dim=-1).mean()), 2),
             "|residual| after": round(float(hs[0].norm(dim=-1).mean()), 2)}]
    for i in range(1, len(hs)):
        rows.append({"term": f"layer {i - 1} output", "|term|": round(float((hs[i] - hs[i - 1]).norm(dim=-1).mean()), 2),
                     "|residual| after": round(float(hs[i].norm(dim=-1).mean()), 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attnres", required=True, help="comma-separated AttnRes model directories")
    ap.add_argument("--standard", default=None, help="a standard-residual twin, for comparison")
    ap.add_argument("--span", type=int, default=100)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="output stem: <out>.md, <out>.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dirs = [d for d in args.attnres.split(",") if d]
    config = json.loads((Path(dirs[0]) / "config.json").read_text())
    ids = repeated_rows(args.rows, args.span, args.seed, config["vocab_size"], config.get("bos_token_id") or 0)
    report: dict[str, Any] = {"attnres": {d: attnres_mixes(d, ids) for d in dirs}}
    cmd = f"python -m bench.depth_mix_weights --attnres {args.attnres}" + (
        f" --standard {args.standard}" if args.standard else "") + f" --out {args.out}"
    lines = [f"# AttnRes depth mixes on `BOS R R`, {args.rows} rows of {args.span} random ids", "", f"`{cmd}`", "",
             "Sources in order: the embedding, then each completed source (block sum, or sub-layer output in Full "
             "AttnRes), then the current block's running sum where there is one. share = a_i |v_i| / sum_j a_j |v_j|.",
             ""]
    for d, rows in report["attnres"].items():
        lines += [f"## {d}", "", "| mix | weight per source | \\|v\\| per source | share per source | query norm |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['mix']} | {', '.join(map(str, r['weight']))} | {', '.join(map(str, r['|v|']))} | "
                  f"{', '.join(map(str, r['share']))} | {r['query norm']} |" for r in rows]
        lines.append("")
    if args.standard:
        report["standard"] = {args.standard: standard_stream(args.standard, ids)}
        lines += [f"## {args.standard} (standard residual: unit weights)", "", "| term | \\|term\\| | \\|residual\\| after |",
                  "|---|---|---|"]
        lines += [f"| {r['term']} | {r['|term|']} | {r['|residual| after']} |" for r in report["standard"][args.standard]]
        lines.append("")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines))
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))
    logger.info("wrote %s.{md,json}", args.out)


if __name__ == "__main__":
    main()
