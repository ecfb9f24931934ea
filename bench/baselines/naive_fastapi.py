"""Baseline (a): the seed's naive service. FastAPI, one asyncio queue, a 5 ms batch window, max batch 8.

No admission control, no deadlines, no fallback: every request waits in the
queue, however long. Run: ``uvicorn bench.baselines.naive_fastapi:app --port P``.

``GET /stats`` says what its decoding has cost while serving: ``decode_cpu_s`` (the
CPU seconds of the event loop's thread inside ``naive_pixels``) over ``decodes``
images, so a benchmark compares a decode measured where it is served with Rampart's
decode pool measured the same way (``bench.ceiling``).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import FastAPI, Request

from bench.baselines.common import answer, load_primary, naive_pixels

BATCH_WINDOW_S = 0.005
MAX_BATCH = 8

app = FastAPI()
engine, labels, resolution = load_primary()
queue: asyncio.Queue = asyncio.Queue()
decoding = {"decode_cpu_s": 0.0, "decodes": 0}


async def batcher() -> None:
    """Take up to MAX_BATCH queued images within BATCH_WINDOW_S of the first, compute, answer each."""
    loop = asyncio.get_running_loop()
    while True:
        items = [await queue.get()]
        deadline = loop.time() + BATCH_WINDOW_S
        while len(items) < MAX_BATCH and (left := deadline - loop.time()) > 0:
            try:
                items.append(await asyncio.wait_for(queue.get(), left))
            except asyncio.TimeoutError:
                break
        batch = np.stack([pixels for pixels, _ in items])
        probs = await loop.run_in_executor(None, engine.predict, batch)
        for (_, future), row in zip(items, probs):
            future.set_result(row)


@app.on_event("startup")
async def start() -> None:
    """Start the batcher task with the app."""
    asyncio.get_running_loop().create_task(batcher())


@app.post("/classify")
async def classify(request: Request) -> dict:
    """Raw image body in, top-5 labels out, after however long the queue takes."""
    body = await request.body()
    started = time.thread_time()
    pixels = naive_pixels(body, resolution)
    decoding["decode_cpu_s"] += time.thread_time() - started
    decoding["decodes"] += 1
    future = asyncio.get_running_loop().create_future()
    await queue.put((pixels, future))
    return answer(await future, labels)


@app.get("/stats")
async def stats() -> dict:
    """The CPU its decoding has cost so far: ``decode_cpu_s`` (s) over ``decodes`` (images)."""
    return dict(decoding)
