"""The Grafana dashboard in deploy/grafana/ read as the tests need it: its PromQL queries, the
metric names each one names, and the names a Prometheus scrape holds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdserve.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
# An identifier not inside a number (1e3); a function or aggregation when '(' follows it.
_IDENT = re.compile(r"(?<![\w.])[a-zA-Z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "atan2"}
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)\s*$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)[{ ]")


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL query: the panels' targets, and the query variables' (`label_values(m, l)`
    read as the query `m`)."""
    found = [t["expr"] for panel in panels(dashboard) for t in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text)
        found.append(match[1] if match else text)
    return found


def metric_names(query: str) -> set[str]:
    """The metric names a PromQL query selects (Grafana's $variables dropped)."""
    text = _STRING.sub('""', query)
    for pattern in (_MATCHERS, _RANGE, _GROUPING, _VARIABLE):
        text = pattern.sub(" ", text)
    return {
        match[0]
        for match in _IDENT.finditer(text)
        if match[0].lower() not in _KEYWORDS and not text[match.end() :].lstrip().startswith("(")
    }


def exported_names(scrape_text: str) -> set[str]:
    """The metric names of a Prometheus text exposition (its samples, not its comments)."""
    return {m[1] for line in scrape_text.splitlines() if (m := _SAMPLE.match(line))}
