"""Every worked example in a docstring (``>>>``) runs: the modules that carry them, found by grep,
so a new example cannot be forgotten."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine", "sinkserve_kernels", "evals", "training")


def modules_with_examples() -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if ">>> " in path.read_text():
                found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_the_examples_are_found() -> None:
    mods = modules_with_examples()
    assert {"app.plan.planner", "engine.outputs", "engine.memory.retention", "engine.config_io"} <= set(mods), mods


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.IGNORE_EXCEPTION_DETAIL)
    assert result.attempted > 0 and result.failed == 0, result
