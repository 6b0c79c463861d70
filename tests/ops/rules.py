"""Readers for the operations files (alert rules, their promtool tests, the dashboard), shared by
the tests in this folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "serve_configs" / "alerts.yaml"
# promtool unit tests of the rules; the day-long baseline cases run at a coarser evaluation interval.
ALERTS_TESTS = (Path(__file__).resolve().parent / "alerts_test.yaml",
                Path(__file__).resolve().parent / "alerts_baseline_test.yaml")
DASHBOARD = ROOT / "serve_configs" / "grafana-dashboard.json"
PROMETHEUS_YML = ROOT / "serve_configs" / "prometheus.yml"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule in serve_configs/alerts.yaml (recording rules left out)."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def rule_exprs() -> Iterator[tuple[str, str]]:
    """(rule name, PromQL) for every rule."""
    for g in yaml.safe_load(ALERTS.read_text())["groups"]:
        for r in g["rules"]:
            yield r.get("alert") or r["record"], r["expr"]


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows included."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    dash = json.loads(DASHBOARD.read_text())
    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            yield p.get("title", "?"), t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            yield f"variable {v['name']}", q["query"] if isinstance(q, dict) else q
