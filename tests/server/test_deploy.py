"""Kubernetes probes and autoscaling triggers against a real server."""

from __future__ import annotations


import httpx

from tests.support import encode, photo
from tests.support.metrics import missing_metrics, queried_metrics
from tests.support.deploy import adapter_rules, container, deployment, scaled_object


def test_probe_paths_and_trigger_metrics_exist(server):
    rampart = container(deployment())
    port = rampart["ports"][0]
    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port["containerPort"] == 3000  # BentoML's default port
    paths = {rampart[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"/readyz", "/livez"}
    for path in paths | {annotations["prometheus.io/path"]}:
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200, path

    # The stage histogram has its first series once a request was answered.
    assert httpx.post(f"{server.url}/classify", content=encode(photo("coffee")), timeout=30).status_code == 200
    queries = [t["metadata"]["query"] for t in scaled_object()["spec"]["triggers"]]
    queries += [rule[key] for rule in adapter_rules() for key in ("seriesQuery", "metricsQuery")]
    queried = queried_metrics(queries)
    assert {"rampart_rejected_total", "rampart_admitted_total", "rampart_stage_duration_seconds_sum"} <= queried
    missing = missing_metrics(server, queried)
    assert not missing, f"the autoscaling queries read metrics that /metrics lacks: {missing}"
