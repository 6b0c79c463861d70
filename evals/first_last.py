"""The seed's first-last consistency claim, judged from two models' needle results (``sinkserve eval needle``).

The claim (seed 003, Attention Residuals): facts seen early stay reachable at the end of long inputs.
The needle eval puts a fact at the start and asks for it at length L = 1x, 4x, 16x the trained context
under each retention arm. Read side by side for a model and its baseline::

    dense 1x: both 0 / n        -> "not measurable": neither retrieves the fact even inside its context,
                                   so a longer input cannot show anything
    every L > 1x: model's best arm  >  baseline's best arm    -> "met"
    otherwise                                                 -> "not met" (the lengths where it is not)

    worked example: baseline dense 1x 6/10, best 4x 2/10, best 16x 1/10;
                    model    dense 1x 7/10, best 4x 5/10, best 16x 1/10  -> not met (16x: 1/10 vs 1/10)

Pure bookkeeping over the needle JSON (no torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
