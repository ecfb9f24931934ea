"""Decode-cost bombs on a real server: fast 4xx, and ordinary uploads right after are served."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support import PHOTOS, SLACK_MS, encode, photo
from tests.support.bombs import BOMBS, SETTINGS


def test_bombs_get_4xx_fast_and_ordinary_uploads_right_after_get_200(server):
    """All bombs at once (far more than the decode workers), then ordinary uploads, one after another: each
    answered 200 with labels within its 1 s deadline (plus slack), and every decode worker alive."""
    timeout_ms = SETTINGS.decoding.timeout_ms

    async def timed(client: httpx.AsyncClient, body: bytes, deadline_ms: int) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        response = await client.post("/classify", content=body, headers={"X-Deadline-Ms": str(deadline_ms)})
        return response, (time.perf_counter() - start) * 1000

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            bombs = await asyncio.gather(*(timed(client, data, 30_000) for data, _ in BOMBS.values()))
            ordinary = [await timed(client, encode(photo(name)), 1000) for name in PHOTOS]  # one after another
            return bombs, ordinary, (await client.get("/stats")).json()

    bombs, ordinary, stats = asyncio.run(scenario())
    for name, (response, elapsed_ms) in zip(BOMBS, bombs):
        assert response.status_code == 422, (name, response.text)
        assert response.json()["error"]["code"] == BOMBS[name][1].code, name
        assert elapsed_ms < timeout_ms + SLACK_MS, (name, elapsed_ms)
    for name, (response, elapsed_ms) in zip(PHOTOS, ordinary):
        assert response.status_code == 200 and response.json()["labels"], (name, response.text)
        assert elapsed_ms < 1000 + SLACK_MS, (name, elapsed_ms)
    workers = stats["decode_workers"]
    assert workers["mode"] == "processes" and workers["alive"] == workers["configured"] == SETTINGS.decoding.workers
