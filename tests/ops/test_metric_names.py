"""The alert rules and the Grafana dashboard use only metrics and labels that exist: the app's (what
app/metrics.py renders from a full snapshot), Prometheus' own (`up`, `job`, `instance`) or Ray
Serve's (names defined in the installed ray package). Renaming a metric in the app fails here
until the rules and the dashboard follow."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app import metrics as m
from tests.ops.promql_names import promql_names
from tests.ops.rules import DASHBOARD, PROMETHEUS_YML, ROOT, dashboard_exprs, rule_exprs

PROMETHEUS_OWN = {"up"}
PROMETHEUS_LABELS = {"job", "instance", "le"}
RAY_LABELS = {"application", "deployment", "replica"}


def _full_snapshot() -> dict:
    """One ingress and one pool replica with every stat set, so every family has a sample."""
    rm = m.RequestMetrics()
    rm.count("short", 200)
    rm.tenant_usage("acme", 3, 4)
    for hist in (rm.ttft, rm.itl, rm.e2e):
        hist["short"].observe(0.05)
    stats = {key: 1 for key, _, _, _ in m.ENGINE_STATS} | {"nll_sum": 2.0, "nll_count": 1, "decode_path": "c_step",
                                                           "decode_steps": [["c_step", 3]],
                                                           "session_kv_fallbacks": [["policy", 1]],
                                                           "session_kv_save_failures": [["error", 1]]}
    return {
        "ingress/i1": {"kind": "ingress", "replica": "i1", "data": rm.snapshot()},
        "pool/p1": {"kind": "pool", "pool": "short", "version": "v1", "replica": "p1", "deployment": "pool-short-v1",
                    "data": {"ready": True, "stats": stats, "policy_version": "p-1", "policy_generation": 1,
                             "tensor_parallel_size": 1, "model": "m"}},
    }


@lru_cache(maxsize=1)
def exported() -> dict[str, frozenset[str]]:
    """Sample name -> label names, as the app renders them (/metrics and /metrics/tenants)."""
    out: dict[str, set[str]] = {}
    for part in ("operational", "tenants"):
        for fam in text_string_to_metric_families(m.render(_full_snapshot(), part).decode()):
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return {k: frozenset(v) for k, v in out.items()}


@lru_cache(maxsize=1)
def ray_serve_source() -> str:
    ray = pytest.importorskip("ray")
    folder = Path(ray.__file__).parent / "serve" / "_private"
    return "\n".join(p.read_text(errors="replace") for p in folder.glob("*.py"))


def _ray_metric_defined(name: str) -> bool:
    """Ray exports metric "x" as "ray_x" (counters with "_total" appended unless already there)."""
    base = name.removeprefix("ray_")
    candidates = {base, base.removesuffix("_total")}
    return any(f'"{c}"' in ray_serve_source() for c in candidates)


ALL_EXPRS = [("alerts.yaml: " + n, e) for n, e in rule_exprs()] + [("dashboard: " + n, e) for n, e in dashboard_exprs()]


def test_the_name_reader_finds_metrics_and_labels():
    names = promql_names(
        'sum by (pool) (rate(a_total{status=~"5..", pool!="x"}[5m] offset 1h)) / ignoring (pool) group_left '
        'sum(rate(b_total[$__rate_interval])) > 0.01 and on () up{job="j"} == 1'
    )
    assert names.metrics == {"a_total", "b_total", "up"}
    assert names.labels == {"pool", "status", "job"}
    assert promql_names('label_values(x_ready{pool=~"$pool"}, version)').metrics == {"x_ready"}
    assert promql_names("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m])))").labels == {"le"}


def test_there_is_something_to_check():
    assert len([e for n, e in ALL_EXPRS if n.startswith("alerts")]) >= 10
    assert len([e for n, e in ALL_EXPRS if n.startswith("dashboard")]) >= 15


@pytest.mark.parametrize("where, expr", ALL_EXPRS, ids=[n for n, _ in ALL_EXPRS])
def test_every_metric_used_is_exported(where, expr):
    names = promql_names(expr)
    assert names.metrics, f"{where}: no metric found in {expr!r}"
    for name in names.metrics:
        if name.startswith("sinkserve_"):
            assert name in exported(), f"{where}: {name} is not exported by app/metrics.py"
        elif name.startswith("ray_"):
            assert _ray_metric_defined(name), f"{where}: {name} is not a metric of the installed Ray Serve"
        else:
            assert name in PROMETHEUS_OWN, f"{where}: {name} is neither the app's, Ray's nor Prometheus' own"


@pytest.mark.parametrize("where, expr", ALL_EXPRS, ids=[n for n, _ in ALL_EXPRS])
def test_every_label_used_exists(where, expr):
    names = promql_names(expr)
    app_labels = set().union(*(exported()[n] for n in names.metrics if n in exported()))
    known = app_labels | PROMETHEUS_LABELS | (RAY_LABELS if any(n.startswith("ray_") for n in names.metrics) else set())
    assert names.labels <= known, f"{where}: labels {sorted(names.labels - known)} not on {sorted(names.metrics)}"


def test_engine_stats_behind_used_metrics_are_produced():
    """A metric only has samples if the engine (or the pool replica) reports its stats key."""
    from dataclasses import fields

    from engine.core.stats import EngineStats

    used = set().union(*(promql_names(e).metrics for _, e in ALL_EXPRS))
    engine_keys = {f.name for f in fields(EngineStats)}  # what engine.stats() reports
    pool_source = (ROOT / "app" / "pool" / "server.py").read_text()  # what the pool replica adds to it
    for key, name, kind, _ in m.ENGINE_STATS:
        if m.PREFIX + name in used:
            assert key in engine_keys or re.search(rf'"{key}"', pool_source), \
                f"{m.PREFIX + name}: stats key {key!r} is reported by nobody"


def test_dashboard_is_importable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for wanted in ("first token", "inter-token", "tokens / s", "kv blocks", "protected and evicted", "perplexity", "queue"):
        assert wanted in titles, f"dashboard has no {wanted!r} panel"


def test_prometheus_config_scrapes_the_app_with_the_rules_loaded():
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert cfg["rule_files"] == ["alerts.yaml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "sinkserve"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    # the alert rules name this job
    assert any('job="sinkserve"' in e for _, e in rule_exprs())


def test_tenant_series_are_only_on_the_tenant_scrape():
    public = m.render(_full_snapshot()).decode()
    tenants = m.render(_full_snapshot(), "tenants").decode()
    assert "sinkserve_tenant_" not in public and "sinkserve_requests_total" in public
    assert "sinkserve_tenant_tokens_total" in tenants and "sinkserve_requests_total" not in tenants
