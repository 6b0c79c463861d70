"""``sinkserve`` command line: a thin dispatcher. Each subcommand lives in its own small module
exposing ``add_parser(subparsers)`` and ``run(args) -> int`` (``serve`` here; ``generate``
is the engine's one-shot generation command)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

SUBCOMMANDS = ("app.cli.serve", "app.cli.cluster", "app.cli.canary", "app.cli.generate", "app.cli.model", "evals.cli")


def _source_tree_tools() -> None:
    """Let a source checkout reach its tools: an editable install maps only the shipped packages
    (sinkserve_kernels, engine, app), while ``evals/`` and ``training/`` sit beside ``app/``. A wheel
    install has no such directory, and ``eval`` / ``model train-indexer`` are then left out of the parser."""
    root = Path(__file__).resolve().parents[2]
    if (root / "evals" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))


def build_parser() -> argparse.ArgumentParser:
    _source_tree_tools()
    parser = argparse.ArgumentParser(prog="sinkserve", description="sinkserve: long-context LLM serving with protected attention sinks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Not installed: ``eval`` lives in the source tree's ``evals`` package, which the wheel leaves out.
            # A module that exists but misses one of its own imports is an error: say so.
            if e.name not in (name, name.partition(".")[0]):
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    # Every subcommand that loads a model may meet an AttnRes directory: register its model_type with
    # transformers' Auto classes (after parsing, so --help stays fast).
    import engine.attnres  # noqa: F401

    return int(args.run(args) or 0)

