"""The request pipeline: decode → primary → fallback → static answer, within one deadline.

``Classifier.classify`` is plain asyncio. It talks to the models through
``ModelEndpoint.call`` coroutines, so the same code runs against BentoML runner
proxies in the service and against stand-ins in unit tests. The deadline
(``X-Deadline-Ms``) covers everything:

- decoding and resizing run on a ``BoundedPool`` (429 when it is full);
- the primary gets the deadline minus ``fallback_reserve_ms``; if it raises, has
  not answered by then, or its runner TTL-dropped the item, the fallback gets
  what is left (``degraded_reason`` ``primary_error`` / ``primary_timeout``);
- if the fallback fails too, the answer is the static default: no labels,
  ``degraded_reason`` ``no_model_available`` and ``needs_review`` true.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from .buckets import Bucket, choose_bucket, fit_to_bucket
from .config import Settings
from .deadline import Deadline
from .decoding import DecodedImage, DecodeLimits, decode_image
from .pool import BoundedPool
from .results import top_labels

__all__ = ["RunnerAnswer", "ModelEndpoint", "Classifier", "decode_limits"]

logger = logging.getLogger("rampart.pipeline")


@dataclass(frozen=True)
class RunnerAnswer:
    """What a runner sent back for one image: float32 ``probs`` (C,) or ``expired``."""

    probs: np.ndarray | None
    inference_ms: float
    batch_size: int

    @property
    def expired(self) -> bool:
        return self.probs is None


#: ``call(bucket_name, pixels uint8 H×W×3, deadline as time.time() seconds)``.
RunnerCall = Callable[[str, np.ndarray, float], Awaitable[RunnerAnswer]]


@dataclass(frozen=True)
class ModelEndpoint:
    """A model as the pipeline sees it: identity, labels, buckets and a call."""

    name: str
    version: str
    labels: list[str]
    buckets: dict[str, Bucket]
    call: RunnerCall


def decode_limits(settings: Settings, buckets: list[Bucket]) -> DecodeLimits:
    """Decode limits from settings; JPEG draft keeps ≥ 2× the largest bucket side."""
    return DecodeLimits(
        max_body_bytes=settings.max_body_bytes,
        max_pixels=settings.max_pixels,
        min_side_px=settings.min_side_px,
        max_aspect_ratio=settings.max_aspect_ratio,
        max_frames=settings.max_frames,
        min_decoded_side=2 * max(max(b.height, b.width) for b in buckets),
        alpha_background=settings.alpha_background,
    )


class Classifier:
    """Classifies one upload within its deadline, degrading honestly; see the module doc."""

    def __init__(self, settings: Settings, primary: ModelEndpoint, fallback: ModelEndpoint, pool: BoundedPool) -> None:
        self.settings = settings
        self.primary = primary
        self.fallback = fallback
        self.pool = pool
        self.limits = decode_limits(settings, [*primary.buckets.values(), *fallback.buckets.values()])

    def _prepare(self, data: bytes) -> tuple[DecodedImage, Bucket, np.ndarray]:
        decoded = decode_image(data, self.limits)
        bucket = choose_bucket(*decoded.image.size, self.primary.buckets)
        return decoded, bucket, fit_to_bucket(decoded.image, bucket, self.settings.crop_margin)

    async def classify(self, data: bytes, top_k: int, deadline: Deadline) -> dict:
        """The response body for one image (see README, "API").

        Raises ``rampart.errors.ImageError`` for a bad upload and ``Overloaded``
        when decoding capacity is exhausted; model failures never raise.
        """
        start = time.perf_counter()
        decoded, bucket, pixels = await self.pool.run(self._prepare, data)
        decode_ms = (time.perf_counter() - start) * 1000.0

        reserve = self.settings.fallback_reserve_ms
        model = self.primary
        answer, reason = await self._attempt(self.primary, bucket, pixels, deadline, reserve)
        if answer is None:
            model = self.fallback
            bucket = choose_bucket(*decoded.image.size, self.fallback.buckets)
            pixels = await self.pool.run_admitted(fit_to_bucket, decoded.image, bucket, self.settings.crop_margin)
            answer, fallback_reason = await self._attempt(self.fallback, bucket, pixels, deadline, 0.0)
            if answer is None:
                logger.warning("fallback failed too (%s) after %s", fallback_reason, reason)
                return self._static_answer(decode_ms, start)

        total_ms = (time.perf_counter() - start) * 1000.0
        return {
            "labels": top_labels(answer.probs, model.labels, top_k),
            "model": {"name": model.name, "version": model.version},
            "degraded": reason is not None,
            "degraded_reason": reason,
            "needs_review": False,
            "bucket": bucket.name,
            "timings_ms": {
                "decode": round(decode_ms, 3),
                "queue": round(max(total_ms - decode_ms - answer.inference_ms, 0.0), 3),
                "inference": round(answer.inference_ms, 3),
                "total": round(total_ms, 3),
            },
        }

    async def _attempt(
        self, model: ModelEndpoint, bucket: Bucket, pixels: np.ndarray, deadline: Deadline, reserve_ms: float
    ) -> tuple[RunnerAnswer | None, str | None]:
        """Call ``model`` within the deadline minus ``reserve_ms``; (answer, None) or (None, reason)."""
        prefix = "primary" if model is self.primary else "fallback"
        budget_s = deadline.remaining_s(reserve_ms)
        if budget_s <= 0:
            return None, f"{prefix}_timeout"
        try:
            answer = await asyncio.wait_for(model.call(bucket.name, pixels, deadline.wall_clock_at(reserve_ms)), budget_s)
        except asyncio.TimeoutError:
            return None, f"{prefix}_timeout"
        except Exception as exc:  # any runner failure degrades; it never becomes a 5xx
            logger.warning("%s failed: %s: %s", model.name, type(exc).__name__, exc)
            return None, f"{prefix}_error"
        if answer.expired:
            return None, f"{prefix}_timeout"
        return answer, None

    def _static_answer(self, decode_ms: float, start: float) -> dict:
        total_ms = (time.perf_counter() - start) * 1000.0
        return {
            "labels": [],
            "model": None,
            "degraded": True,
            "degraded_reason": "no_model_available",
            "needs_review": True,
            "bucket": None,
            "timings_ms": {"decode": round(decode_ms, 3), "queue": 0.0, "inference": 0.0, "total": round(total_ms, 3)},
        }
