"""runners.common's service configuration: what each runner service asks BentoML for."""

from __future__ import annotations

import re

import pytest

from rampart.config import Settings
from runners.common import runner_tracing_config
from runners.fallback import Fallback
from runners.primary import Primary


@pytest.mark.parametrize("service", [Primary, Fallback], ids=lambda s: s.name)
def test_runner_routes_are_left_out_of_tracing_by_default(service):
    excluded = service.config["tracing"]["excluded_urls"]
    for route in ("/square", "/landscape", "/portrait", "/stats"):
        assert route in {api.route for api in service.apis.values()}
        # BentoML searches each pattern in the request URL (opentelemetry.util.http.ExcludeList)
        assert any(re.search(pattern, f"http://127.0.0.1:3000{route}") for pattern in excluded), route


def test_runner_spans_come_back_with_either_tracing_setting():
    assert runner_tracing_config(Settings()) != {}
    assert runner_tracing_config(Settings(telemetry={"trace_runner_calls": True})) == {}
    assert runner_tracing_config(Settings(telemetry={"trace_requests": True})) == {}
