"""The metric and label names a PromQL expression uses -- enough PromQL to check our own rules and
dashboard against what the app exports (not a full parser: no nested braces in strings, and
functions are recognised by the '(' after their name)."""

from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                      "group_left", "group_right", "inf", "nan"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_OFFSET = re.compile(r"\boffset\s+-?[\w$]+")
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*,\s*([A-Za-z_]\w*)\s*\)")


@dataclass(frozen=True)
class Names:
    metrics: frozenset[str]
    labels: frozenset[str]


def promql_names(expr: str) -> Names:
    """Metric names and label names (matchers, by/on/ignoring/group lists) in ``expr``. A Grafana
    ``label_values(metric{...}, label)`` query is understood too."""
    lv = _LABEL_VALUES.fullmatch(expr.strip())
    if lv:
        inner = promql_names(lv.group(1) + (lv.group(2) or ""))
        return Names(inner.metrics, inner.labels | {lv.group(3)})
    s = _STRING.sub('""', expr)
    labels: set[str] = set()
    for body in _MATCHERS.findall(s):
        labels.update(_MATCHER_LABEL.findall(body))
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)  # ranges, subqueries, Grafana's [$__rate_interval]
    for body in _GROUPING.findall(s):
        labels.update(x.strip() for x in body.split(",") if x.strip())
    s = _GROUPING.sub(" ", s)
    s = _OFFSET.sub(" ", s)
    metrics = {m for m in _IDENT.findall(s) if m.lower() not in KEYWORDS}
    return Names(frozenset(metrics), frozenset(labels))
