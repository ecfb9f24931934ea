"""grafana/rampart-dashboard.json against ``rampart.telemetry``: the Grafana dashboard queries only metrics Rampart
declares, no server.

On a real server, tests/server/test_observability.py (default settings), test_cascade.py and
test_shadow.py (the metrics of those modes) check that each queried name is served.
"""

from __future__ import annotations

import json
import re

from prometheus_client import Counter, Histogram

from rampart.telemetry import metrics
from tests.support import ROOT

#: Sample-name suffixes prometheus_client adds to a family's name, by metric type.
SUFFIXES = {Counter: ("_total",), Histogram: ("_bucket", "_sum", "_count")}


def declared_samples() -> set[str]:
    """Every sample name the collectors of ``rampart.telemetry.metrics`` can expose."""
    names = set()
    for value in vars(metrics).values():
        for kind, suffixes in SUFFIXES.items():
            if isinstance(value, kind):
                names |= {value._name + suffix for suffix in suffixes}
        if hasattr(value, "_name") and not isinstance(value, (Counter, Histogram)):
            names.add(value._name)
    return names


def test_every_rampart_metric_the_dashboard_queries_is_declared():
    dashboard = json.loads((ROOT / "grafana" / "rampart-dashboard.json").read_text())
    exprs = [re.sub(r'"[^"]*"', '""', target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\b(rampart_[a-z0-9_]+)", expr)}
    assert {"rampart_cascade_routes_total", "rampart_cascade_confidence_bucket", "rampart_shadow_requests_total",
            "rampart_shadow_top1_agreed_total", "rampart_shadow_latency_seconds_bucket"} <= queried
    assert not queried - declared_samples(), f"undeclared metrics in the dashboard: {queried - declared_samples()}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
