"""Stand-in models for in-process tests of the pipeline and the HTTP layer (faults injected on purpose), and the
stand-in pipeline and app built on them: ``stand_in_pipeline``, ``stand_in_chain``, ``served_pipeline`` and
the app ``Rig`` (the ``make_rig`` and ``rig`` fixtures of tests/unit/conftest.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from starlette.testclient import TestClient

from rampart.api.app import create_app, route_error_answered
from rampart.api.lifecycle import Lifecycle
from rampart.api.routing import JSONRouteErrors
from rampart.config import Settings
from rampart.inputs.buckets import buckets_for_resolution
from rampart.inputs.pool import BoundedPool
from rampart.pipeline import Pipeline, ModelEndpoint, RunnerResult, decode_pool
from tests.support import encode, photo

#: The stand-ins' class names: 1000 classes, like the default ImageNet-1k models.
LABELS = [f"class {i}" for i in range(1000)]
#: Request bodies of the app tests: real photos as JPEG (a cat, a cup of coffee).
CAT = encode(photo("chelsea"))
COFFEE = encode(photo("coffee"))
#: The model names the service gives its endpoints (the stand-in app answers with them).
SERVED_NAMES = ("rampart-primary", "rampart-fallback")


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

    async def call(self, bucket_name: str, pixels: np.ndarray, deadline: float) -> RunnerResult:
        self.calls += 1
        self.deadlines.append(deadline)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "error":
            raise RuntimeError("injected model failure")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "expired":
            return RunnerResult(probs=None, inference_ms=0.0, batch_size=1)
        if self.mode == "garbage":
            return RunnerResult(probs="not an array", inference_ms=1.0, batch_size=1)
        others = len(LABELS) - 1 - (self.runner_up > 0)
        probs = np.full(len(LABELS), (1.0 - self.score - self.runner_up) / others, dtype=np.float32)
        probs[self.best] = self.score
        if self.runner_up > 0:
            probs[0] = self.runner_up
        return RunnerResult(probs=probs, inference_ms=1.0, batch_size=1)

    def endpoint(self, name: str, resolution: int) -> ModelEndpoint:
        """This stand-in as the pipeline's ``ModelEndpoint`` named ``name``, with the buckets of ``resolution``."""
        return ModelEndpoint(name, "v1", LABELS, buckets_for_resolution(resolution), self.call)


def stand_in_pipeline(settings: Settings, primary: StandIn, fallback: StandIn, pool: BoundedPool | None = None,
                      names: tuple[str, str] = ("primary", "fallback")) -> Pipeline:
    """A real ``rampart.pipeline.Pipeline`` on two stand-ins: ``primary`` at 260 px and ``fallback`` at 224 px
    (the default models' resolutions), named ``names``, decoding on ``pool`` (default a 2-thread pool with 8 places)."""
    return Pipeline(settings, primary.endpoint(names[0], 260), fallback.endpoint(names[1], 224),
                    pool or BoundedPool(2, 8))


def stand_in_chain(settings: Settings, pool: BoundedPool | None = None, fail: bool = False,
                   delay_s: float = 0.0) -> Pipeline:
    """``stand_in_pipeline`` with a primary answering class 1 (raising when ``fail``, slept ``delay_s`` s
    before answering) and a fallback answering class 2."""
    primary, fallback = StandIn(1), StandIn(2)
    primary.mode = "error" if fail else "ok"
    primary.delay_s = delay_s
    return stand_in_pipeline(settings, primary, fallback, pool)


def served_pipeline(settings: Settings, primary: StandIn, fallback: StandIn) -> Pipeline:
    """``stand_in_pipeline`` as the service builds it: the models named ``SERVED_NAMES``, decoding on the
    settings' own pool (``rampart.pipeline.decode_pool``)."""
    return stand_in_pipeline(settings, primary, fallback, decode_pool(settings), SERVED_NAMES)


@dataclass
class Rig:
    """An app and what the tests poke: its client, both stand-in models, pipeline and lifecycle."""

    client: TestClient
    primary: StandIn
    fallback: StandIn
    pipeline: Pipeline
    lifecycle: Lifecycle


def open_rig(ready: bool = True, **overrides) -> Rig:
    """A real app (``rampart.api.app.create_app`` behind ``JSONRouteErrors``) on ``served_pipeline`` with a
    primary answering class 281 (a tabby cat) and a fallback answering 967 (espresso), a thread decode pool of
    2 and ``overrides`` for the other settings; its lifecycle marked ready unless ``ready`` is False. The
    client is entered; ``close_rig`` leaves it."""
    settings = Settings(decode_mode="threads", decode_workers=2, **overrides)
    primary, fallback = StandIn(best=281), StandIn(best=967)
    pipeline = served_pipeline(settings, primary, fallback)
    lifecycle = Lifecycle()
    if ready:
        lifecycle.mark_ready()
    app = create_app(settings, pipeline=pipeline, lifecycle=lifecycle)
    client = TestClient(JSONRouteErrors(app, answered=route_error_answered), raise_server_exceptions=False)
    return Rig(client.__enter__(), primary, fallback, pipeline, lifecycle)


def close_rig(rig: Rig) -> None:
    """Leave the rig's client (the app's lifespan ends)."""
    rig.client.__exit__(None, None, None)


def fill(gate) -> list:
    """Take every place of an admission gate (dispatch window and queue), as concurrent requests would."""
    return [gate.reserve(False, 60.0) for _ in range(gate.window + gate.queue_limit)]
