"""Reading the app's Prometheus metrics the way an operator's scraper does: every Ray node's
metrics agent, over HTTP, summed over the series that carry the given labels."""

from __future__ import annotations

import re
import time
import urllib.request

_LINE = re.compile(r"^(?:ray_)?(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape() -> str:
    import ray

    texts = []
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                texts.append(response.read().decode())
    return "\n".join(texts)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples (with or without Ray's `ray_` prefix) whose labels include
    `labels`; 0.0 when there is none."""
    total = 0.0
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None or match["name"] != name:
            continue
        found = dict(_LABEL.findall(match["labels"] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match["value"])
    return total


# Ray's metrics agents export on their own period, and lag on a loaded machine (the engines'
# vLLM series go through them too).
EXPORT_WAIT_S = 120.0


def wait_metric(name: str, want: float, timeout_s: float = EXPORT_WAIT_S, **labels: str) -> float:
    """Poll the agents until `name` sums to `want` (they export on their own period); returns
    the last value seen, so the caller's assert shows what was there."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_sum(scrape(), name, **labels)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(1.0)


def wait_metric_at_least(
    name: str, want: float, timeout_s: float = EXPORT_WAIT_S, **labels: str
) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_sum(scrape(), name, **labels)
        if value >= want or time.monotonic() > deadline:
            return value
        time.sleep(1.0)


def settled_metric(
    name: str, quiet_s: float = 6.0, timeout_s: float = EXPORT_WAIT_S, **labels: str
) -> float:
    """`name`'s sum once it has not moved for `quiet_s` (three of the test clusters' 2 s export
    periods): a baseline read right after other requests may miss their counts still on the
    way, and a later exact-count check then sees them as extra."""
    deadline = time.monotonic() + timeout_s
    value = metric_sum(scrape(), name, **labels)
    since = time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(1.0)
        now = metric_sum(scrape(), name, **labels)
        if now != value:
            value, since = now, time.monotonic()
    return value
