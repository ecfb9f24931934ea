"""Stand-in models for in-process tests of the pipeline and the HTTP layer (faults injected on purpose)."""

from __future__ import annotations

import asyncio

import numpy as np

from rampart.inputs.buckets import buckets_for_resolution
from rampart.pipeline import ModelEndpoint, RunnerAnswer

#: The stand-ins' class names: 1000 classes, like the default ImageNet-1k models.
LABELS = [f"class {i}" for i in range(1000)]


class StandIn:
    """A model that answers class ``best`` with probability ``score`` (and ``runner_up`` for class 0, when
    given; the rest shared evenly), unless ``mode`` injects a fault: ``error`` raises, ``hang`` sleeps past
    any deadline, ``expired`` returns a runner's TTL drop, ``garbage`` returns probabilities that are not
    an array (Rampart's own bug: a 500). ``delay_s`` (s) is slept before any answer, like a slow model;
    ``calls`` counts the calls and ``deadlines`` keeps each call's ``deadline_epoch_s``."""

    def __init__(self, best: int, score: float = 0.9, runner_up: float = 0.0) -> None:
        self.best, self.score, self.runner_up, self.mode, self.calls = best, score, runner_up, "ok", 0
        self.delay_s = 0.0
        self.deadlines: list[float] = []

    async def call(self, bucket_name: str, pixels: np.ndarray, deadline: float) -> RunnerAnswer:
        self.calls += 1
        self.deadlines.append(deadline)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "error":
            raise RuntimeError("injected model failure")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "expired":
            return RunnerAnswer(probs=None, inference_ms=0.0, batch_size=1)
        if self.mode == "garbage":
            return RunnerAnswer(probs="not an array", inference_ms=1.0, batch_size=1)
        others = len(LABELS) - 1 - (self.runner_up > 0)
        probs = np.full(len(LABELS), (1.0 - self.score - self.runner_up) / others, dtype=np.float32)
        probs[self.best] = self.score
        if self.runner_up > 0:
            probs[0] = self.runner_up
        return RunnerAnswer(probs=probs, inference_ms=1.0, batch_size=1)

    def endpoint(self, name: str, resolution: int) -> ModelEndpoint:
        """This stand-in as the pipeline's ``ModelEndpoint`` named ``name``, with the buckets of ``resolution``."""
        return ModelEndpoint(name, "v1", LABELS, buckets_for_resolution(resolution), self.call)
