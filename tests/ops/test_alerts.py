"""The alert rules are valid PromQL, and each fires on a bad synthetic series and stays silent on a
good one (promtool runs tests/ops/alerts*_test.yaml); every rule has a test of each kind and a
runbook line. promtool comes from Debian's `prometheus` package (.ci/run installs it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.ops.rules import ALERTS, ALERTS_TESTS, ROOT, alert_rules

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not on PATH: `apt-get install prometheus` (Debian) to run the alert-rule tests",
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@needs_promtool
def test_rules_pass_promtool_check():
    out = _promtool("check", "rules", str(ALERTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


@needs_promtool
def test_rules_pass_promtool_unit_tests():
    out = _promtool("test", "rules", *map(str, ALERTS_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(ALERTS_TESTS), out.stdout


def test_every_rule_has_a_firing_and_a_silent_case():
    fires: set[str] = set()
    silent: set[str] = set()
    cases = [case for f in ALERTS_TESTS for case in yaml.safe_load(f.read_text())["tests"]]
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), "rules with no test where they fire"
    assert names - silent == set(), "rules with no test where they stay silent"
    assert (fires | silent) - names == set(), "tests of rules that do not exist"


def test_every_rule_has_severity_and_a_runbook_section():
    doc = (ROOT / "docs" / "operations.md").read_text()
    anchors = {_anchor(line) for line in doc.splitlines() if line.startswith("#")}
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        runbook = rule["annotations"]["runbook"]
        path, _, rest = runbook.partition("#")
        assert path == "docs/operations.md", f"{rule['alert']}: runbook must point into docs/operations.md"
        assert rest.split(" ", 1)[0] in anchors, f"{rule['alert']}: no section #{rest.split(' ', 1)[0]} in docs/operations.md"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, spaces to '-', punctuation dropped."""
    text = heading.lstrip("#").strip().lower()
    return "".join(c for c in text.replace(" ", "-") if c.isalnum() or c in "-_")


@needs_promtool
def test_prometheus_config_passes_promtool_check():
    out = _promtool("check", "config", "serve_configs/prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 1 rule files found" in out.stdout + out.stderr
