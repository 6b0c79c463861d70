"""``sinkserve`` command line: a thin dispatcher. Each subcommand lives in its own small module
exposing ``add_parser(subparsers)`` and ``run(args) -> int`` (``cli_serve`` here; ``cli_generate``
is the engine's one-shot generation command)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ("app.cli_serve", "app.cli_cluster", "app.cli_canary", "app.cli_generate", "app.cli_model", "evals.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sinkserve", description="sinkserve: long-context LLM serving with protected attention sinks")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but one of its imports is missing: say so
                raise
            continue  # subcommand not installed in this tree yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    # Every subcommand that loads a model may meet an AttnRes directory: register its model_type with
    # transformers' Auto classes (after parsing, so --help stays fast).
    import engine.attnres  # noqa: F401

    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
