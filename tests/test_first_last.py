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
