"""``runners.common.BucketedRunner.run_bucket``: items whose deadline passed are never computed, also when
the deadline passed while the runner was stalled before the batch (an injected delay or hang)."""

from __future__ import annotations

import threading
import time

import numpy as np

from rampart.faults import FaultInjector, FaultSpec
from rampart.inputs.buckets import buckets_for_resolution
from rampart.heap import IdleTrim
from runners.common import BucketedRunner, RunnerItem

RESOLUTION = 224


class CountingEngine:
    """Uniform probabilities over 10 classes; ``images`` counts the images it was asked to compute."""

    def __init__(self) -> None:
        self.images = 0

    def predict(self, batch: np.ndarray) -> np.ndarray:
        self.images += len(batch)
        return np.full((len(batch), 10), 0.1, np.float32)


def runner(delay_ms: float) -> tuple[BucketedRunner, CountingEngine]:
    """A runner with the attributes ``setup`` gives one (no process placement), a counting engine, and
    ``delay_ms`` injected before every batch."""
    bucketed = BucketedRunner()
    bucketed.role, bucketed.engine = "shadow", CountingEngine()
    bucketed.buckets = buckets_for_resolution(RESOLUTION)
    bucketed.faults = FaultInjector("shadow", FaultSpec(delay_ms=delay_ms))
    bucketed.compute_batch_size, bucketed.ttl_dropped, bucketed._lock = 4, 0, threading.Lock()
    bucketed.heap_trim = IdleTrim(0.0)
    return bucketed, bucketed.engine


def items(name: str, bucketed: BucketedRunner, deadlines_s: list[float]) -> list[RunnerItem]:
    shape = bucketed.buckets[name].shape
    return [RunnerItem(pixels=np.zeros(shape, np.uint8), deadline_epoch_s=time.time() + d, request_id=f"r{i}")
            for i, d in enumerate(deadlines_s)]


def test_items_that_expire_while_the_runner_is_stalled_are_dropped_not_computed():
    bucketed, engine = runner(delay_ms=300)
    name = next(iter(bucketed.buckets))
    results = bucketed.run_bucket(name, items(name, bucketed, [0.1, 0.15, 30.0]))
    assert [r.expired for r in results] == [True, True, False]
    assert engine.images == 1 and bucketed.ttl_dropped == 2
    assert results[2].batch_size == 1 and results[2].probs.shape == (10,)


def test_a_batch_that_expired_in_full_computes_nothing():
    bucketed, engine = runner(delay_ms=0)
    name = next(iter(bucketed.buckets))
    results = bucketed.run_bucket(name, items(name, bucketed, [-1.0, -0.5]))
    assert all(r.expired and r.probs.size == 0 for r in results)
    assert engine.images == 0 and bucketed.ttl_dropped == 2
