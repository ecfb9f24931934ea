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


@pytest.mark.parametrize("role, variable", [("primary", "RAMPART_PRIMARY_MODEL"), ("shadow", "RAMPART_SHADOW_MODEL")])
def test_a_model_missing_from_the_store_stops_the_service_definition_naming_the_way_out(role, variable):
    """BentoML resolved a missing model only when each runner worker started (which the server restarted), with a
    message about a "cloud context"; the service definition now stops at once and names ``make models`` and the
    setting that chose the tag."""
    from runners.common import model_store_dir, require_stored_model

    require_stored_model("rampart-primary:latest", "primary")  # imported by `make models`: no error
    with pytest.raises(RuntimeError) as missing:
        require_stored_model("rampart-not-imported:v1", role)
    message = str(missing.value)
    assert "'rampart-not-imported:v1'" in message and "make models" in message and variable in message
    assert model_store_dir() in message
