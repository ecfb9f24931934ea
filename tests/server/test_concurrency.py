"""400 requests in flight at once: all answered, no 5xx, real adaptive batches, with 2 API workers.

With the default queueing delay (200 ms) most of 400 simultaneous requests would be
shed (429, see tests/server/test_overload.py); here the server accepts a minute of
queueing, so every request must be answered, by the primary, in real batches.
This is also the regression test for the BentoML dependency-proxy defect of
1.4.30-1.4.40 (see docs/design.md, "Why BentoML 1.4.29").

The server runs 2 API workers (``RAMPART_API_WORKERS=2``), the harder configuration:
two admission gates share each runner, and Rampart's metrics on ``/metrics`` must
count both workers' answers whichever worker serves the scrape. One worker is
covered by the session server and the rest of the suite.
"""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.support import PHOTOS, encode, photo

IN_FLIGHT = 400


def batch_size_counts(metrics: str, histogram: str, label: str) -> dict[float, float]:
    """Cumulative bucket counts of ``histogram`` over the series whose labels contain ``label``."""
    counts: dict[float, float] = {}
    pattern = re.compile(rf'^{histogram}_bucket\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)$')
    for line in metrics.splitlines():
        match = pattern.match(line)
        if match and label in match["labels"]:
            le = re.search(r'le="([^"]+)"', match["labels"]).group(1)
            counts[float(le)] = counts.get(float(le), 0.0) + float(match["value"])
    return counts


def test_400_in_flight_all_answered_with_batching(start_server):
    server = start_server(RAMPART_API_WORKERS=2, RAMPART_PRIMARY_QUEUE_DELAY_MS=60000,
                          RAMPART_FALLBACK_QUEUE_DELAY_MS=60000)
    images = [(name, encode(photo(name))) for name in sorted(PHOTOS)]

    async def drive() -> list[tuple[str, httpx.Response]]:
        limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            async def one(i: int):
                name, body = images[i % len(images)]
                return name, await client.post("/classify", content=body, headers={"X-Deadline-Ms": "60000"})

            return await asyncio.gather(*(one(i) for i in range(IN_FLIGHT)))

    responses = asyncio.run(drive())
    statuses = [response.status_code for _, response in responses]
    assert statuses.count(200) == IN_FLIGHT, {s: statuses.count(s) for s in set(statuses)}
    for name, response in responses:
        result = response.json()
        assert result["degraded"] is False, result
        assert {label["index"] for label in result["labels"][:3]} & PHOTOS[name], (name, result)

    metrics = httpx.get(f"{server.url}/metrics").text
    # BentoML's adaptive batching ran, and the primary computed images together: Rampart's images per computed
    # batch. (BentoML's own histogram counts runner *calls* per batch; the entry service already sends the images
    # waiting for a bucket as one call, so in one CI run all 52 batches were one call each, of 7.7 images on average.)
    assert batch_size_counts(metrics, "bentoml_service_adaptive_batch_size", 'runner_name="rampart_primary"')
    counts = batch_size_counts(metrics, "rampart_batch_size", 'model="primary"')
    assert counts, "no batch-size samples for the primary"
    total, size_one = max(counts.values()), counts.get(1.0, 0.0)
    assert total > size_one, f"every primary batch computed one image: {counts}"

    # Both workers answered, and the metrics add up their answers (prometheus_client multiprocess files).
    api_pids = {re.search(r'pid="(\d+)"', line)[1] for line in metrics.splitlines()
                if line.startswith("rampart_process_resident_memory_bytes{") and 'role="api"' in line}
    assert len(api_pids) == 2, api_pids
    answered = re.search(r'^rampart_responses_total\{code="ok",status="200"\} (\S+)$', metrics, re.M)
    assert answered and float(answered[1]) == IN_FLIGHT, answered
    worker = httpx.get(f"{server.url}/stats").json()["api_worker"]  # /stats is one worker's own view
    assert worker["of"] == 2 and worker["index"] in (1, 2) and str(worker["pid"]) in api_pids, worker
