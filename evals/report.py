"""Result tables and plots shared by the long-context evals.

An eval returns an :class:`EvalResult` (rows of plain values, an optional with/without-protection A/B
table, and plot panels); :func:`write_report` turns it into ``<name>.md``, ``<name>.json`` and
``<name>.png`` in one folder, so both evals render identically and the JSON is the machine-readable twin
of the markdown.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Series:
    """One line of a plot panel."""

    label: str
    x: list[float]
    y: list[float]
    style: str = "-"  # matplotlib format string; "o" for isolated points (e.g. dense at 1x only)


@dataclass
class Panel:
    """One subplot."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    logx: bool = False
    logy: bool = False
    hlines: list[tuple[float, str]] = field(default_factory=list)  # (y, label) reference lines
    ylim: tuple[float, float] | None = None


@dataclass
class EvalResult:
    """Everything one eval run produced. ``rows`` share the keys listed in ``columns``."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ab_columns: list[str] = field(default_factory=list)
    ab_rows: list[dict[str, Any]] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # bulky per-token/per-doc data, JSON only
    ab_title: str = "With / without protection (same inputs)"  # heading of the second table
    tables: list[tuple[str, list[str], list[dict[str, Any]]]] = field(default_factory=list)  # (heading, columns, rows)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _cell(text: str) -> str:
    """A ``|`` inside a cell or a column name would end the cell: escape it."""
    return text.replace("|", "\\|")


def markdown_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A GitHub markdown table; missing cells are blank; ``|`` in names and cells escaped.

    >>> print(markdown_table(["|h|", "n"], [{"|h|": 1.5, "n": "a|b"}]))
    | \\|h\\| | n |
    |---|---|
    | 1.5 | a\\|b |
    """
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(_fmt(row.get(c, ""))) for c in columns) + " |")
    return "\n".join(lines)


def render_markdown(result: EvalResult) -> str:
    parts = [f"# {result.title}", ""]
    if result.meta:
        parts += [f"- {k}: `{v}`" for k, v in result.meta.items()] + [""]
    parts += [markdown_table(result.columns, result.rows), ""]
    if result.ab_rows:
        parts += [f"## {result.ab_title}", "", markdown_table(result.ab_columns, result.ab_rows), ""]
    for heading, columns, rows in result.tables:
        parts += [f"## {heading}", "", markdown_table(columns, rows), ""]
    if result.notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    if result.panels:
        parts += [f"![{result.name}]({result.name}.png)", ""]
    return "\n".join(parts)


def plot(result: EvalResult, path: Path) -> None:
    """One PNG with a row of panels (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(result.panels))
    fig, axes = plt.subplots(n, 1, figsize=(9, 3.6 * n), squeeze=False)
    for ax, panel in zip(axes[:, 0], result.panels):
        for s in panel.series:
            ax.plot(s.x, s.y, s.style, label=s.label, markersize=6)
        for y, label in panel.hlines:
            ax.axhline(y, color="grey", linestyle=":", label=label)
        if panel.logx:
            ax.set_xscale("log", base=2)
        if panel.logy:
            ax.set_yscale("log")
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: EvalResult, out_dir: Path) -> dict[str, Path]:
    """Write ``<name>.md``, ``<name>.json`` and ``<name>.png`` under ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{result.name}.{ext}" for ext in ("md", "json", "png")}
    paths["md"].write_text(render_markdown(result))
    blob = asdict(result)
    blob.pop("panels")  # the plot data is in rows/extra already; keep the JSON about numbers
    paths["json"].write_text(json.dumps(blob, indent=1, default=float) + "\n")
    plot(result, paths["png"])
    logger.info("wrote %s", ", ".join(str(p) for p in paths.values()))
    return paths


def emit(text: str, out: Path | None) -> int:
    """Print ``text`` and write it to ``out`` (parent folders made); the exit status of a finished run.
    The CLI tail of every script that writes one Markdown table (``evals/*_http.py``, ``bench/*``)."""
    print(text)  # noqa: T201 - a CLI's result
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0
