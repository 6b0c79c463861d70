"""Where a benchmark's Markdown goes: standard output, and the ``--out`` file when one is given."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: Path | None) -> int:
    """Print ``text`` and write it to ``out`` (parent folders made); the exit status of a finished run."""
    print(text)  # noqa: T201 - a CLI's result
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0
