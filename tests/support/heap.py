"""Jobs for decode worker processes that report what their C heap costs (importable by a worker, unlike a test)."""

from __future__ import annotations

import resource

from rampart.inputs.decode_job import DecodePlan, prepare


def faults_per_prepare(data: bytes, plan: DecodePlan, calls: int) -> float:
    """Minor page faults of this process per ``prepare(data, plan)``, over ``calls`` calls after one warm-up call."""
    prepare(data, plan)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        prepare(data, plan)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
