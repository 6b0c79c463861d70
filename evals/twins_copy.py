"""The twins' first-last comparison table (issue 41): ``sinkserve eval twins-copy``.

Reads two ``python -m evals.copy_gain`` result files -- the twins (standard and AttnRes, the same inputs)
and the positive control (the reference model, the same points in fractions of its own context) -- and
writes ``<out>/twins_copy.{md,json,png}``: per span kind and point, each twin's copy (nats/token, mean
and 95 % t-interval), the AttnRes-minus-standard difference paired by sample with its interval, and the
reference model's copy; then the gate and the verdict of ``evals.first_last.twins_verdict`` (the rule,
fixed before the run, is in docs/attnres.md). Pure bookkeeping over the JSON (no torch)::

    kind    point               standard          AttnRes           AttnRes - standard   reference
    random  dense reach 0.5x    +5.10 [4.9, 5.3]  +5.40 [5.2, 5.6]  +0.30 [+0.1, +0.5]   +6.9 [..]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evals.first_last import (JUDGED, find_point, gains, mean_ci, paired_diff, point_x, twins_gate,
                              twins_verdict)
from evals.report import EvalResult, Panel, Series


def _fmt(v: tuple[float, float, float]) -> str:
    return f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"


def _label(p: dict[str, Any]) -> str:
    return f"dense, reach {point_x(p):g}x" if p["arm"] == "dense" else f"{p['arm']}, {point_x(p):g}x"


def load_points(paths: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The points of one result file, or of several (comma-separated: e.g. one run per span kind, run in
    parallel), in order; the first file's meta, with every file's command and wall time."""
    points: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for path in str(paths).split(","):
        data = json.loads(Path(path).read_text())
        points += data["points"]
        m = data.get("meta", {})
        meta = meta or dict(m)
        meta.setdefault("runs", []).append({k: m.get(k) for k in ("command", "loadavg", "wall_s")})
    return points, meta


def _key(points: list[dict[str, Any]], model: str, where: Any) -> str:
    """The name ``model`` has in the results (the CLI passes resolved paths, the results hold the typed ones)."""
    names = list(points[0]["second"]) if points else []
    for n in names:
        if n == model or Path(n).resolve() == Path(model).resolve():
            return n
    raise ValueError(f"{where} has no results for {model} (it has {names})")


def build_report(twins_json: str | Path, baseline: str, model: str, reference_json: str | Path | None = None,
                 ) -> EvalResult:
    """The table, the gate, the verdict and the plot (module docstring)."""
    points, meta = load_points(twins_json)
    ref_points, ref_meta = load_points(reference_json) if reference_json else ([], {})
    ref = ref_meta.get("models", [None])[0] if ref_meta else None
    if ref is None and ref_points:
        ref = next(iter(ref_points[0]["second"]))
    baseline, model = (_key(points, m, twins_json) for m in (baseline, model))
    judged = {(k, a, x) for k, a, x in JUDGED}
    rows = []
    for p in points:
        cb, cm, d = mean_ci(gains(p, baseline)), mean_ci(gains(p, model)), paired_diff(p, baseline, model)
        rp = find_point(ref_points, p["kind"], p["arm"], point_x(p)) if ref_points else None
        row = {"kind": p["kind"], "point": _label(p), "L": p["L"], "n": len(gains(p, model)),
               "standard copy": _fmt(cb), "AttnRes copy": _fmt(cm), "AttnRes - standard (paired)": _fmt(d),
               "judged": "yes" if any(abs(point_x(p) - x) < 0.02 and p["kind"] == k and p["arm"] == a
                                      for k, a, x in judged) else "",
               "reference copy": _fmt(mean_ci(gains(rp, ref))) if rp is not None and ref else "",
               "reference L": rp["L"] if rp is not None else ""}
        rows.append(row)
    _, gate = twins_gate(points, [baseline, model])
    verdict = twins_verdict(points, baseline, model)
    panels = []
    for kind in sorted({p["kind"] for p in points}, key=lambda k: ("random", "fact", "instruction").index(k)
                       if k in ("random", "fact", "instruction") else 9):
        dense = sorted((p for p in points if p["kind"] == kind and p["arm"] == "dense"), key=point_x)
        series = []
        for name, m in (("standard", baseline), ("AttnRes", model)):
            series.append(Series(name, [point_x(p) for p in dense], [mean_ci(gains(p, m))[0] for p in dense], "o-"))
        rdense = sorted((p for p in ref_points if p["kind"] == kind and p["arm"] == "dense"), key=point_x)
        if rdense and ref:
            series.append(Series("reference model", [point_x(p) for p in rdense],
                                 [mean_ci(gains(p, ref))[0] for p in rdense], "s--"))
        series.append(Series("AttnRes - standard (paired)", [point_x(p) for p in dense],
                             [paired_diff(p, baseline, model)[0] for p in dense], "^:"))
        for arm in sorted({p["arm"] for p in points if p["arm"] != "dense"}):
            past = sorted((p for p in points if p["kind"] == kind and p["arm"] == arm), key=point_x)
            for name, m in (("standard", baseline), ("AttnRes", model)):
                series.append(Series(f"{name} {arm}", [point_x(p) for p in past],
                                     [mean_ci(gains(p, m))[0] for p in past], "x"))
        panels.append(Panel(f"{kind}: copy vs reach (dense, <= 0.9x) and input length (arms, 2x / 4x)",
                            "reach (dense) or input length (arms), x trained context", "copy, nats/token", series,
                            hlines=[(0.0, "0")]))
    return EvalResult(
        name="twins_copy", title="AttnRes vs standard twin: first-last copy, paired by sample (issue 41)",
        columns=["kind", "point", "L", "n", "standard copy", "AttnRes copy", "AttnRes - standard (paired)", "judged",
                 "reference copy", "reference L"],
        rows=rows,
        meta={"twins": str(twins_json), "reference": str(reference_json), "baseline": baseline, "model": model,
              "reference_model": ref, "gate": gate, "verdict": verdict,
              "twins_runs": meta.get("runs"), "twins_context": meta.get("trained_context"),
              "twins_samples": meta.get("samples"), "reference_runs": ref_meta.get("runs"),
              "reference_context": ref_meta.get("trained_context"), "reference_samples": ref_meta.get("samples")},
        notes=["copy = NLL(second occurrence | decoy first) - NLL(second occurrence), nats/token; intervals: 95 % "
               "Student t over samples (differences paired by sample: the same inputs for both twins)",
               "reach = start of the 2nd occurrence - start of the 1st, as a fraction of the trained context; "
               "the reference model's points are at the same fractions of its own context (1,024)",
               f"gate: {gate}", f"verdict: {verdict}"],
        panels=panels)
