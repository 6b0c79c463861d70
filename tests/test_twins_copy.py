"""The issue-41 gate, verdict and table (evals.first_last.twins_*, evals.twins_copy): pure bookkeeping."""

from __future__ import annotations

import json
from pathlib import Path

from evals.first_last import JUDGED, twins_gate, twins_verdict
from evals.twins_copy import build_report


def _point(kind, arm, x, std, ar, decoy=8.0):
    dense = arm == "dense"
    return {"kind": kind, "arm": arm, "L": int(x * 512), "x_reach": x if dense else None,
            "x_context": x if not dense else x + 0.1,
            "decoy": {"s": [decoy] * len(std), "a": [decoy] * len(ar)},
            "second": {"s": [decoy - v for v in std], "a": [decoy - v for v in ar]}}


def _points(std_gate, ar_gate, diffs):
    pts = [_point("random", "dense", 0.5, std_gate, ar_gate)]
    for (k, a, x), d in zip(JUDGED, diffs):
        pts.append(_point(k, a, x, [1.0, 1.1, 0.9, 1.0], [1.0 + d + e for e in (0.0, 0.1, -0.1, 0.02)]))
    return pts


def test_gate_needs_both_twins_over_one_nat():
    ok, why = twins_gate(_points([2.0, 2.2, 1.8, 2.1], [0.9, 1.0, 0.8, 0.9], [0.5] * 5), ["s", "a"])
    assert not ok and "gate failed" in why
    assert twins_gate(_points([2.0] * 4, [1.5, 1.2, 1.1, 1.3], [0.5] * 5), ["s", "a"])[0]


def test_verdict_met_not_met_and_not_compared():
    gate = [2.0, 2.2, 1.8, 2.1]
    assert twins_verdict(_points(gate, gate, [0.5] * 5), "s", "a").startswith("met")
    v = twins_verdict(_points(gate, gate, [0.5, 0.5, -0.5, 0.5, 0.5]), "s", "a")
    assert v.startswith("not met: baseline ahead at fact sinks_window_anchor 4x")
    v = twins_verdict(_points(gate, gate, [0.5, 0.0, 0.5, 0.5, 0.5]), "s", "a")
    assert v.startswith("not met: no difference resolved at fact sinks_window_anchor 2x")
    assert twins_verdict(_points(gate, [0.2] * 4, [0.5] * 5), "s", "a").startswith("not compared")


def test_report_pairs_the_twins_and_adds_the_control(tmp_path: Path):
    gate = [2.0, 2.2, 1.8, 2.1]
    twins = tmp_path / "t.json"
    twins.write_text(json.dumps({"points": _points(gate, gate, [0.5] * 5), "meta": {"samples": 4}}))
    ref_pts = [_point("random", "dense", 0.5, [6.0] * 4, [6.0] * 4)]
    for p in ref_pts:
        for key in ("decoy", "second"):
            p[key] = {"r": p[key]["s"]}
    ref = tmp_path / "r.json"
    ref.write_text(json.dumps({"points": ref_pts, "meta": {"models": ["r"]}}))
    res = build_report(twins, "s", "a", ref)
    assert res.rows[0]["reference copy"].startswith("+6.000") and res.rows[1]["reference copy"] == ""
    assert res.rows[0]["AttnRes - standard (paired)"].startswith("+0.000")
    assert [r["judged"] for r in res.rows] == [""] + ["yes"] * 5
    assert res.meta["verdict"].startswith("met") and len(res.panels) == 3


def test_results_of_parallel_runs_are_read_together(tmp_path: Path):
    gate = [2.0, 2.2, 1.8, 2.1]
    pts = _points(gate, gate, [0.5] * 5)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"points": pts[:1], "meta": {"command": "run a", "wall_s": 1.0}}))
    b.write_text(json.dumps({"points": pts[1:], "meta": {"command": "run b", "wall_s": 2.0}}))
    res = build_report(f"{a},{b}", "s", "a")
    assert len(res.rows) == 6 and res.meta["verdict"].startswith("met")
    assert [r["command"] for r in res.meta["twins_runs"]] == ["run a", "run b"]
