"""The canary gate's decisions: pure functions over the evidence, and the config edits that move traffic.

A candidate model version is deployed at weight 0 beside the stable one (``versions:`` in the serve
config). ``sinkserve canary`` (``app/cli/canary.py``) asks both, pinned by name (``model:
"<served>@<version>"``), the first-last consistency set -- held-out documents whose fact sits at the
start and whose question sits at the end -- and gives the answers to :func:`decide`. A candidate that
retrieves at least as well as the stable version (within ``max_drop``) at every length, with no failed
request, is promoted in steps; otherwise it is rolled back to weight 0::

    >>> stable = [Evidence("v1", "0.9x", 15, 16, 0)]
    >>> decide(stable, [Evidence("v2", "0.9x", 15, 16, 0)]).promote
    True
    >>> decide(stable, [Evidence("v2", "0.9x", 9, 16, 0)]).promote
    False

Traffic moves through the Ingress deployment's ``user_config`` (``{"weights": {...}}``), which Serve
applies to running replicas without a restart (``Ingress.reconfigure``): :func:`with_weights` writes it
into the config that ``serve deploy`` receives.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Evidence:
    """One version's answers at one length: how many were right, how many asked, how many failed."""

    version: str
    length: str
    correct: int
    total: int
    errors: int = 0

    @property
    def rate(self) -> float:
        return self.correct / self.total if self.total else 0.0


@dataclass(frozen=True)
class Verdict:
    promote: bool
    lines: tuple[str, ...]  # the evidence, one line per length, and why


def decide(stable: list[Evidence], candidate: list[Evidence], max_drop: float = 0.05) -> Verdict:
    """Promote only if, at every length the stable version was asked, the candidate answered the same
    number of documents without a failed request and its retrieval rate is at most ``max_drop`` below."""
    lines, ok = [], True
    by_length = {e.length: e for e in candidate}
    for s in stable:
        c = by_length.get(s.length)
        if c is None:
            lines.append(f"{s.length}: candidate not measured -> roll back")
            ok = False
            continue
        good = c.errors == 0 and c.total == s.total and c.rate >= s.rate - max_drop
        ok &= good
        lines.append(f"{s.length}: {s.version} {s.correct}/{s.total} ({s.rate:.2f}), {c.version} {c.correct}/{c.total} "
                     f"({c.rate:.2f}), {c.errors} failed -> {'pass' if good else 'FAIL'} (allowed drop {max_drop:.2f})")
    if not stable:
        lines.append("no evidence from the stable version -> roll back")
        ok = False
    return Verdict(ok, tuple(lines))


def steps_for(percents: list[float]) -> list[float]:
    """Validated promotion steps: increasing percentages of traffic for the candidate, ending at 100.

    >>> steps_for([5, 25, 100])
    [5.0, 25.0, 100.0]
    """
    out = [float(p) for p in percents]
    if not out or out[-1] != 100.0 or any(not 0 < p <= 100 for p in out) or out != sorted(set(out)):
        raise ValueError(f"steps: increasing percentages in (0, 100] ending at 100, got {percents}")
    return out


def step_weights(versions: list[str], stable: str, candidate: str, percent: float) -> dict[str, float]:
    """Weights that give ``candidate`` ``percent`` of the traffic and ``stable`` the rest; every other
    version goes to 0 (one canary at a time)."""
    weights = {v: 0.0 for v in versions}
    weights[candidate] = float(percent)
    weights[stable] = 100.0 - float(percent)
    return weights


def with_weights(config: dict[str, Any], app_name: str, weights: dict[str, float]) -> dict[str, Any]:
    """A copy of the serve ``config`` whose application ``app_name`` sets the Ingress deployment's
    ``user_config`` to ``{"weights": weights}`` (other deployment overrides are kept).

    >>> cfg = {"applications": [{"name": "sinkserve", "args": {}}]}
    >>> with_weights(cfg, "sinkserve", {"v1": 95.0, "v2": 5.0})["applications"][0]["deployments"]
    [{'name': 'Ingress', 'user_config': {'weights': {'v1': 95.0, 'v2': 5.0}}}]
    """
    out = copy.deepcopy(config)
    apps = [a for a in out.get("applications", []) if a.get("name") == app_name]
    if not apps:
        raise ValueError(f"no application named {app_name!r} in the config")
    deployments = apps[0].setdefault("deployments", [])
    ingress = next((d for d in deployments if d.get("name") == "Ingress"), None)
    if ingress is None:
        ingress = {"name": "Ingress"}
        deployments.append(ingress)
    ingress["user_config"] = {**(ingress.get("user_config") or {}), "weights": dict(weights)}
    return out
