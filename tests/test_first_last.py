"""The first-last consistency verdict over two needle results (``evals/first_last.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ConfigError
from evals.first_last import load_needle, verdict


def _needle(tmp_path: Path, name: str, correct: dict[tuple[str, int], int], docs: int = 10) -> Path:
    d = tmp_path / name
    d.mkdir()
    rows = [{"arm": arm, "x_context": float(x), "docs": docs, "correct": c} for (arm, x), c in correct.items()]
    (d / "needle.json").write_text(json.dumps({"meta": {"model_sha256": name}, "rows": rows}))
    return d


def test_verdict_follows_the_worked_example(tmp_path: Path) -> None:
    base = load_needle(_needle(tmp_path, "b", {("dense", 1): 6, ("window_only", 4): 1, ("sinks_window", 4): 2,
                                               ("sinks_window", 16): 1}))
    model = load_needle(_needle(tmp_path, "m", {("dense", 1): 7, ("window_only", 4): 5, ("sinks_window", 4): 0,
                                                ("sinks_window", 16): 1}))
    assert base.best(4.0) == (2, 10) and model.best(4.0) == (5, 10) and base.model_sha256 == "b"
    assert verdict(base, model) == "not met at 16x (best arm, model vs baseline: 4x 5/10 vs 2/10; 16x 1/10 vs 1/10)"
    better = load_needle(_needle(tmp_path, "m2", {("dense", 1): 7, ("sinks_window", 4): 5, ("sinks_window", 16): 3}))
    assert verdict(base, better).startswith("met (")


def test_no_retrieval_in_context_is_not_measurable(tmp_path: Path) -> None:
    zero = {("dense", 1): 0, ("sinks_window", 4): 0}
    v = verdict(load_needle(_needle(tmp_path, "b", zero)), load_needle(_needle(tmp_path, "m", zero)))
    assert v.startswith("not measurable") and "baseline 0/10, model 0/10" in v
    with pytest.raises(ConfigError, match="needle"):
        load_needle(tmp_path / "missing")


def _point(kind: str, arm: str, L: int, gains: dict[str, list[float]]) -> dict:
    """A copy-gain point whose per-sample copies are ``gains`` (2nd after a decoy 5.0, 2nd 5.0 - copy); the
    first occurrence costs 5.5 (so 1st - 2nd = 0.5 + copy: a context effect the verdict must not count)."""
    return {"kind": kind, "arm": arm, "L": L, "gap": L - 128, "x_context": round(L / 1024, 3),
            "first": {m: [5.5] * len(g) for m, g in gains.items()},
            "decoy": {m: [5.0] * len(g) for m, g in gains.items()},
            "second": {m: [5.0 - x for x in g] for m, g in gains.items()}}


def _points(in_context_b: list[float], in_context_m: list[float], long_b: list[float], long_m: list[float]) -> list:
    return [_point("fact", "dense", 228, {"b": in_context_b, "m": in_context_m}),
            _point("fact", "dense", 1023, {"b": in_context_b, "m": [x + 0.1 for x in in_context_b]}),
            _point("fact", "sinks_window", 16384, {"b": [0.0, 0.01, -0.01, 0.0], "m": [0.5, 0.5, 0.5, 0.5]}),
            _point("fact", "sinks_window_anchor", 16384, {"b": long_b, "m": long_m})]


def test_copy_verdict_met_not_met_not_measurable() -> None:
    from evals.first_last import copy_verdict, first_last

    copies = [0.3, 0.32, 0.28, 0.3]
    met = _points(copies, copies, [0.2, 0.22, 0.18, 0.2], [0.3, 0.34, 0.28, 0.31])
    assert copy_verdict(met, "b", "m").startswith("met (fact span")
    # the docstring's worked example: at 16x the difference straddles 0 -> not met there (and only there);
    # the control arm (sinks_window) is never judged, however large its difference
    tie = _points(copies, copies, [0.2, 0.2, 0.2, 0.2], [0.3, 0.1, 0.25, 0.15])
    v = copy_verdict(tie, "b", "m")
    assert v.startswith("not met at 16x (") and "gap 895 +0.100" in v and "0.000 [-0.145, +0.145])" in v
    worse = _points(copies, copies, [0.3, 0.32, 0.28, 0.3], [0.1, 0.12, 0.08, 0.1])
    assert copy_verdict(worse, "b", "m").startswith("not met at 16x")
    # no copying in context for either model (intervals include 0) -> not measurable, whatever the rest says
    noise = [0.05, -0.05, 0.02, -0.03]
    flat = _points(noise, [-0.1, 0.1, 0.0, 0.01], [0.2, 0.22, 0.18, 0.2], [0.3, 0.34, 0.28, 0.31])
    v = copy_verdict(flat, "b", "m")
    assert v.startswith("not measurable at this scale: neither model copies the fact span") and "gap 100" in v
    # one model copying in context is enough to measure
    assert copy_verdict(_points(noise, copies, [0.2, 0.22, 0.18, 0.2], [0.3, 0.34, 0.28, 0.31]), "b", "m")[:4] == "met "
    assert copy_verdict(met, "b", "m", kind="random").startswith("not measurable: no in-context random")


def test_first_last_uses_the_needle_when_it_can_tell(tmp_path: Path) -> None:
    from evals.first_last import first_last

    copies = [0.3, 0.32, 0.28, 0.3]
    points = _points(copies, copies, [0.2, 0.22, 0.18, 0.2], [0.3, 0.34, 0.28, 0.31])
    zero = {("dense", 1): 0, ("sinks_window", 4): 0}
    blind = (load_needle(_needle(tmp_path, "b0", zero)), load_needle(_needle(tmp_path, "m0", zero)))
    source, text = first_last(blind, points, "b", "m")
    assert source == "copy gain" and text.startswith("met (fact span") and "needle not measurable" in text
    seeing = (load_needle(_needle(tmp_path, "b1", {("dense", 1): 6, ("sinks_window", 4): 2})),
              load_needle(_needle(tmp_path, "m1", {("dense", 1): 6, ("sinks_window", 4): 1})))
    assert first_last(seeing, points, "b", "m") == ("needle", "not met at 4x (best arm, model vs baseline: 4x 1/10 vs 2/10)")
    assert first_last(blind, None, "b", "m")[1].startswith("not measurable at this scale")
    assert first_last(None, points, "b", "m")[0] == "copy gain"
