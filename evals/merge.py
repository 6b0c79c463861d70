"""Merge the reports of one eval run as several processes (one arm each, in parallel) into one report.

    python -m evals.merge long-ppl --out docs/evals/smollm2 DIR_A/long_ppl.json DIR_B/long_ppl.json ...

``long-ppl``: rows, the per-segment table, the moving-average curves and the memory traces of every part,
the commands that produced them, and the targets of issue 36 (sinks + window past the context against
dense within it; window only against the same). A part run with ``--tokens`` equal to the trained context
and ``--arms dense`` is "dense within the context".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from evals.report import EvalResult, Panel, Series, markdown_table, write_report


def _load(paths: list[str]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text()) for p in paths]


def merge_long_ppl(parts: list[dict[str, Any]], target: float = 1.10) -> EvalResult:
    """One long-ppl report from parts that each ran some arms over the same text."""
    rows = [r for p in parts for r in p["rows"]]
    seg_rows = [r for p in parts for _, _, rs in p.get("tables", []) for r in rs]
    seg_cols: list[str] = []
    for p in parts:
        for _, cols, _ in p.get("tables", []):
            seg_cols += [c for c in cols if c not in seg_cols]
    ctx = parts[0]["meta"]["trained_context"]
    by_arm = {r["arm"]: r for r in rows}
    seg = {r["arm"]: r for r in seg_rows}
    past = next((c for c in seg_cols if c.startswith("past the context")), None)
    notes: list[str] = []
    dense = by_arm.get("dense")
    if dense is not None and past is not None:
        d_in = dense["ppl"]
        for arm in ("sinks_window", "window_only"):
            if arm in seg:
                p_arm = seg[arm][past]
                verdict = f" -> {'MET' if p_arm <= target * d_in else 'MISSED'}" if arm == "sinks_window" else ""
                per_seg = ", ".join(f"{c} {seg[arm][c]:.2f}" for c in seg_cols[1:] if c != past)
                notes.append(f"{arm}: ppl past the context (tokens {ctx}..) {p_arm:.3f} = {p_arm / d_in:.3f}x dense "
                             f"within the context ({d_in:.3f}, tokens 1..{dense['tokens']}; target <= {target:.2f}x)"
                             f"{verdict}; per context length: {per_seg}")
    for p in parts:
        notes += [n for n in p.get("notes", []) if "flat memory" in n]
    smooth: dict[str, Any] = {}
    blocks: dict[str, Any] = {}
    for p in parts:
        smooth.update(p.get("extra", {}).get("moving_ppl", {}))
        blocks.update(p.get("extra", {}).get("blocks_trace", {}))
    labels = {r["arm"]: r["context"] for r in rows}
    panels = [Panel(title=f"per-token perplexity, moving average (trained context {ctx})", xlabel="token position",
                    ylabel="perplexity", logy=True,
                    series=[Series(labels.get(a, a), xs, ys) for a, (xs, ys) in smooth.items()],
                    hlines=[(dense["ppl"], "dense within the context")] if dense is not None else [])]
    if blocks:
        panels.append(Panel(title="KV blocks in use along the stream", xlabel="token position", ylabel="blocks_used",
                            series=[Series(labels.get(a, a), [float(x) for x, _ in tr], [float(b) for _, b in tr])
                                    for a, tr in blocks.items()]))
    meta = dict(parts[0]["meta"])
    for key in ("command", "stream_tokens", "stream_multiple_of_context", "wall_s_total"):
        meta.pop(key, None)
    meta["commands"] = [p["meta"].get("command", "") for p in parts]
    meta["stream_tokens"] = {r["arm"]: r["tokens"] + 1 for r in rows}
    meta["wall_s"] = {r["arm"]: r["wall_s"] for r in rows}
    result = EvalResult(parts[0]["name"], parts[0]["title"], list(rows[0]), rows, meta, notes, panels=panels,
                        extra={"moving_ppl": smooth, "blocks_trace": blocks})
    if seg_rows:
        result.tables.append(("Perplexity per context-length segment of the stream", seg_cols, seg_rows))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("eval", choices=("long-ppl",))
    parser.add_argument("parts", nargs="+", help="the parts' JSON reports")
    parser.add_argument("--out", required=True, help="folder for the merged report")
    parser.add_argument("--name", help="report name (default: the parts')")
    args = parser.parse_args(argv)
    result = merge_long_ppl(_load(args.parts))
    if args.name:
        result.name = args.name
    write_report(result, Path(args.out))
    print(markdown_table(result.columns, result.rows))
    for heading, cols, rows in result.tables:
        print(f"\n{heading}\n" + markdown_table(cols, rows))
    for n in result.notes:
        print("-", n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
