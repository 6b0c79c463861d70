"""Where a benchmark's Markdown goes: standard output, and the ``--out`` file when one is given
(``evals.report.emit``; benchmarks sit on top of evals)."""

from __future__ import annotations

from evals.report import emit

__all__ = ["emit"]
