"""Reading a real server's /metrics: samples by name and labels, their totals, and the metric names PromQL
expressions (the Grafana dashboard's) query."""

from __future__ import annotations

import json
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT


def scrape(server) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted label items: value}}`` from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of sample ``name`` over the series whose labels include ``labels`` (per-process ``pid`` series left out)."""
    wanted = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if wanted <= set(k) and ("pid", "") not in k)


def queried_metrics(exprs: list[str]) -> set[str]:
    """The ``rampart_*`` / ``bentoml_*`` sample names that PromQL expressions ``exprs`` read."""
    unquoted = [re.sub(r'"[^"]*"', '""', expr) for expr in exprs]  # label values are not metric names
    return {name for expr in unquoted for name in re.findall(r"\b((?:rampart|bentoml)_[a-z0-9_]+)", expr)}


def missing_metrics(server, queried: set[str]) -> set[str]:
    """The names in ``queried`` that the server's /metrics lacks (GPU-only gauges excused on CPU)."""
    from rampart.telemetry import metrics

    # The GPU gauges get values only where CUDA is present; on CPU they are only declared.
    gpu_only = {g.describe()[0].name for g in (metrics.GPU_MEMORY_USED, metrics.GPU_MEMORY_TOTAL)}
    available = set(scrape(server))
    return {name for name in queried - gpu_only if name not in available}


def dashboard_metrics(prefix: str = "") -> set[str]:
    """The metric names the Grafana dashboard queries (``queried_metrics``) that start with ``prefix``."""
    dashboard = json.loads((ROOT / "grafana" / "rampart-dashboard.json").read_text())
    queried = queried_metrics([target["expr"] for panel in dashboard["panels"] for target in panel["targets"]])
    return {name for name in queried if name.startswith(prefix)}
