"""The seed's first-last consistency claim, judged from two models' needle results (``sinkserve eval needle``)
or, where the needle cannot tell, from their first-last copy gain (``evals.copy_gain``).

The claim (seed 003, Attention Residuals): facts seen early stay reachable at the end of long inputs.
The needle eval puts a fact at the start and asks for it at length L = 1x, 4x, 16x the trained context
under each retention arm. Read side by side for a model and its baseline::

    dense 1x: both 0 / n        -> "not measurable": neither retrieves the fact even inside its context,
                                   so a longer input cannot show anything
    every L > 1x: model's best arm  >  baseline's best arm    -> "met"
    otherwise                                                 -> "not met" (the lengths where it is not)

    worked example: baseline dense 1x 6/10, best 4x 2/10, best 16x 1/10;
                    model    dense 1x 7/10, best 4x 5/10, best 16x 1/10  -> not met (16x: 1/10 vs 1/10)

Copy gain (the continuous measure; rule fixed before the twins were measured)::

    per sample i and point (span kind, arm, L): copy_i = NLL(S, 2nd | decoy) - NLL(S, 2nd)   nats/token
    (the same input with another span at the start: only the earlier copy differs; evals.copy_gain),
    mean and 95 % t-interval over the n samples (the same inputs for both models, so the model-minus-
    baseline difference d_i = copy_i(model) - copy_i(baseline) pairs sample by sample)

    in context  the shortest gap, dense: neither model's copy has its 95 % interval above 0
                -> "not measurable": neither copies the span even in context
    judged      the longest gap that fits the trained context (dense), and every L past it under
                sinks + window + anchor (the arm that keeps the early span; sinks + window, which evicts
                it, is the control)
    "met"       d's 95 % interval lies above 0 at every judged point (the model's early span is more
                reachable at the end than the baseline's by more than the sample-to-sample spread)
    otherwise   "not met" at the points where it does not

    worked example (n = 4): in context both gains ~0.3 with intervals above 0 -> measurable;
                 d at 1x-gap 0.10, 0.12, 0.08, 0.10 -> mean 0.10, interval [0.07, 0.13]   above 0
                 d at 16x     0.10, -0.10, 0.05, -0.05 -> mean 0.0, interval [-0.15, 0.15] -> not met at 16x

The twins are one training run each, so the interval covers the inputs only, not training seeds; a
"met" would still be a one-seed result. The verdict is judged per span kind; the headline is ``fact``.

Pure bookkeeping over the needle JSON and the copy-gain points (no torch).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError


@dataclass(frozen=True)
class NeedleSummary:
    """One model's needle result: correct / docs per (arm, x_context), and the model it measured."""

    path: str
    model_sha256: str | None
    points: dict[tuple[str, float], tuple[int, int]]

    def dense_1x(self) -> tuple[int, int]:
        return self.points.get(("dense", 1.0), (0, 0))

    def best(self, x: float) -> tuple[int, int]:
        """The best arm's (correct, docs) at ``x`` times the trained context."""
        return max((v for (_, xc), v in self.points.items() if xc == x), key=lambda v: v[0] / max(1, v[1]),
                   default=(0, 0))

    def long_lengths(self) -> list[float]:
        return sorted({x for _, x in self.points if x > 1.0})


def load_needle(folder: str | Path) -> NeedleSummary:
    """``needle.json`` from a ``sinkserve eval needle --out`` folder (or the file itself)."""
    path = Path(folder)
    path = path / "needle.json" if path.is_dir() else path
    if not path.exists():
        raise ConfigError("needle", f"no needle results at {path}")
    data = json.loads(path.read_text())
    points: dict[tuple[str, float], tuple[int, int]] = {}
    for row in data.get("rows", []):
        key = (str(row["arm"]), float(row["x_context"]))
        c, n = points.get(key, (0, 0))
        points[key] = (c + int(row["correct"]), n + int(row["docs"]))
    return NeedleSummary(str(path), data.get("meta", {}).get("model_sha256"), points)


def verdict(baseline: NeedleSummary, model: NeedleSummary) -> str:
    """``met`` / ``not met`` / ``not measurable`` with the figures behind it (module docstring)."""
    def frac(v: tuple[int, int]) -> str:
        return f"{v[0]}/{v[1]}"

    b1, m1 = baseline.dense_1x(), model.dense_1x()
    if b1[0] == 0 and m1[0] == 0:
        return (f"not measurable at this scale: neither model retrieves the fact even inside its context "
                f"(dense 1x: baseline {frac(b1)}, model {frac(m1)})")
    lengths = sorted(set(baseline.long_lengths()) & set(model.long_lengths()))
    if not lengths:
        return "not measurable: no length beyond the trained context in both results"
    cells = [f"{x:g}x {frac(model.best(x))} vs {frac(baseline.best(x))}" for x in lengths]
    short = [x for x in lengths
             if model.best(x)[0] / max(1, model.best(x)[1]) <= baseline.best(x)[0] / max(1, baseline.best(x)[1])]
    head = "met" if not short else "not met at " + ", ".join(f"{x:g}x" for x in short)
    return f"{head} (best arm, model vs baseline: {'; '.join(cells)})"


# Two-sided 95 % Student t quantiles by degrees of freedom (normal beyond the table).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 24: 2.064, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t-interval of the mean (``low = high = mean`` for one sample).

    >>> [round(v, 3) for v in mean_ci([0.10, 0.12, 0.08, 0.10])]
    [0.1, 0.074, 0.126]
    """
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, m, m
    df = len(xs) - 1
    t = _T975.get(df) or next((v for k, v in sorted(_T975.items()) if k >= df), 1.960)
    h = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - h, m + h


def gains(point: dict[str, Any], model: str, measure: str = "copy") -> list[float]:
    """Per-sample ``copy`` (NLL 2nd after a decoy - NLL 2nd) or ``gain`` (NLL 1st - NLL 2nd) of ``model`` at a
    copy-gain point (``evals.copy_gain.run_copy_gain``)."""
    before = point["decoy" if measure == "copy" else "first"][model]
    return [a - b for a, b in zip(before, point["second"][model])]


def _ci(v: tuple[float, float, float]) -> str:
    return f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"


def copy_verdict(points: list[dict[str, Any]], baseline: str, model: str, kind: str = "fact",
                 judged_arm: str = "sinks_window_anchor") -> str:
    """``met`` / ``not met`` / ``not measurable`` from the copy gain of one span kind (module docstring)."""
    mine = [p for p in points if p["kind"] == kind]
    dense = sorted((p for p in mine if p["arm"] == "dense"), key=lambda p: p["L"])
    if not dense:
        return f"not measurable: no in-context {kind} points"
    short = dense[0]
    cb, cm = mean_ci(gains(short, baseline)), mean_ci(gains(short, model))
    if cb[1] <= 0 and cm[1] <= 0:
        return (f"not measurable at this scale: neither model copies the {kind} span even in context "
                f"(copy at gap {short['gap']}, nats/token, mean [95 % CI]: baseline {_ci(cb)}, model {_ci(cm)})")
    judged = [dense[-1]] + sorted((p for p in mine if p["arm"] == judged_arm), key=lambda p: p["L"])
    cells, short_of = [], []
    for p in judged:
        d = mean_ci([a - b for a, b in zip(gains(p, model), gains(p, baseline))])
        where = f"gap {p['gap']}" if p["arm"] == "dense" else f"{p['x_context']:g}x"
        cells.append(f"{where} {_ci(d)}")
        if d[1] <= 0:
            short_of.append(where)
    head = "met" if not short_of else "not met at " + ", ".join(short_of)
    return f"{head} ({kind} span, model minus baseline copy, nats/token, mean [95 % CI]: {'; '.join(cells)})"


def first_last(needle: tuple[NeedleSummary, NeedleSummary] | None, copy_points: list[dict[str, Any]] | None,
               baseline: str, model: str) -> tuple[str, str]:
    """``(source, verdict)``: the needle's verdict when it is measurable, else the copy gain's (``fact``
    span), saying why; ``source`` is ``"needle"`` or ``"copy gain"``."""
    nv = verdict(*needle) if needle is not None else None
    if nv is not None and not nv.startswith("not measurable"):
        return "needle", nv
    if copy_points is None:
        return "needle", nv or "not measurable: neither needle results nor copy-gain points"
    cv = copy_verdict(copy_points, baseline, model)
    why = f"; needle {nv}" if nv is not None else ""
    return "copy gain", cv + why


# --- Issue 41: twins that copy, compared point by point (rule fixed before the run; docs/attnres.md) ---

GATE_KIND, GATE_REACH, GATE_MIN = "random", 0.5, 1.0
# (kind, arm, x): x is the reach (dense) or the input length (past the context), in fractions of the context
JUDGED = (("fact", "dense", 0.9), ("fact", "sinks_window_anchor", 2.0), ("fact", "sinks_window_anchor", 4.0),
          ("instruction", "dense", 0.9), ("instruction", "sinks_window_anchor", 4.0))


def point_x(p: dict[str, Any]) -> float:
    """A point's position: its reach (dense, fraction of the context) or its length (past the context)."""
    return float(p["x_reach"]) if p.get("x_reach") is not None else float(p["x_context"])


def find_point(points: list[dict[str, Any]], kind: str, arm: str, x: float) -> dict[str, Any] | None:
    return next((p for p in points if p["kind"] == kind and p["arm"] == arm and abs(point_x(p) - x) < 0.02), None)


def twins_gate(points: list[dict[str, Any]], models: list[str]) -> tuple[bool, str]:
    """Both twins copy in context: mean ``GATE_KIND`` copy >= ``GATE_MIN`` nats/token at reach ``GATE_REACH``.

    >>> pts = [{"kind": "random", "arm": "dense", "x_reach": 0.5, "x_context": 0.6,
    ...         "decoy": {"a": [8.0, 8.0], "b": [8.0, 8.0]}, "second": {"a": [7.0, 7.5], "b": [1.0, 2.0]}}]
    >>> twins_gate(pts, ["a", "b"])[0]
    False
    """
    p = find_point(points, GATE_KIND, "dense", GATE_REACH)
    if p is None:
        return False, f"no {GATE_KIND} dense point at reach {GATE_REACH}x: the gate cannot be read"
    cells, ok = [], True
    for m in models:
        c = mean_ci(gains(p, m))
        ok &= c[0] >= GATE_MIN
        cells.append(f"{Path(m).name} {_ci(c)}")
    head = "passed" if ok else "failed"
    return ok, (f"gate {head}: {GATE_KIND}-span copy at reach {GATE_REACH:g}x, nats/token, mean [95 % CI] "
                f"(needs >= {GATE_MIN:+.1f} for both): {'; '.join(cells)}")


def paired_diff(p: dict[str, Any], baseline: str, model: str) -> tuple[float, float, float]:
    """Mean and 95 % t-interval of ``copy(model) - copy(baseline)`` paired by sample."""
    return mean_ci([a - b for a, b in zip(gains(p, model), gains(p, baseline))])


def twins_verdict(points: list[dict[str, Any]], baseline: str, model: str) -> str:
    """``met`` (the AttnRes twin's paired copy difference has its interval above 0 at every judged point),
    ``not met: baseline ahead at ...`` (an interval below 0), else ``not met: no difference resolved at ...``;
    ``not compared`` when the gate fails."""
    ok, gate = twins_gate(points, [baseline, model])
    if not ok:
        return f"not compared ({gate})"
    cells, above, below = [], [], []
    for kind, arm, x in JUDGED:
        p = find_point(points, kind, arm, x)
        where = f"{kind} {arm} {x:g}x"
        if p is None:
            cells.append(f"{where} missing")
            continue
        d = paired_diff(p, baseline, model)
        cells.append(f"{where} {_ci(d)}")
        (above if d[1] > 0 else below if d[2] < 0 else []).append(where)
    if len(above) == len(JUDGED):
        head = "met"
    elif below:
        head = "not met: baseline ahead at " + ", ".join(below)
    else:
        head = "not met: no difference resolved at " + ", ".join(w for w in (f"{k} {a} {x:g}x" for k, a, x in JUDGED)
                                                                  if w not in above)
    return f"{head} (model minus baseline copy, nats/token, mean [95 % CI]: {'; '.join(cells)}); {gate}"
