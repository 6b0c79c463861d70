"""The chaos suite: faults injected through the real request path (``inject/sitecustomize.py``), each
case bounded in time and request count, loopback only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).resolve().parent / "inject"


def inject_env() -> dict[str, str]:
    """Environment that makes a new Python process load the fault injector."""
    return {"SINKSERVE_CHAOS_INJECT": "1", "SINKSERVE_CHAOS_REPO": str(REPO),
            "PYTHONPATH": os.pathsep.join([str(INJECT), str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture()
def faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes started by this test (engine children) carry the fault injector."""
    for k, v in inject_env().items():
        monkeypatch.setenv(k, v)


def record(case: str, **figures: object) -> None:
    """Keep a case's measured figures (not asserted: timings vary by machine) in the file
    ``SINKSERVE_CHAOS_RECORD`` names, for ``make chaos`` to write into docs/chaos.md."""
    import json

    path = os.environ.get("SINKSERVE_CHAOS_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, **figures}) + "\n")
