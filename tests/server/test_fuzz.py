"""Mutated photos against a real server: only 2xx or 4xx."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from tests.support.fuzz import mutated_images


@pytest.fixture(scope="module")
def mutated_bodies() -> list[bytes]:
    bodies: list[bytes] = []

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutated_images())
    def collect(data):
        bodies.append(data)

    collect()
    return bodies


def test_server_answers_mutated_bodies_with_2xx_or_4xx(server, mutated_bodies):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        statuses = [client.post("/classify", content=body).status_code for body in mutated_bodies]
    assert all(200 <= s < 500 for s in statuses), sorted(set(statuses))
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
