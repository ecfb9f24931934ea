"""Size buckets: a small fixed set of input shapes per model.

Every image is sent to the bucket whose aspect ratio is nearest its own
(compared in log space, so 2:1 and 1:2 are equally far from 1:1), scaled so it
covers the bucket times a crop margin, and centre-cropped. Each bucket has its
own adaptive-batching queue in the runners, so a batch never mixes shapes.

For a model of resolution ``r`` the buckets are ``square`` r×r, ``landscape``
r×⌊4r/3⌋ and ``portrait`` ⌊4r/3⌋×r (height×width): 260 → 260×346 / 346×260 for
EfficientNet-Lite2 and 224 → 224×298 / 298×224 for EfficientNet-Lite0. 4:3 is the
shape of most camera photos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image

# One thread: a bucket resize takes about 0.1 ms, and each decode worker is one of several processes.
cv2.setNumThreads(1)

__all__ = ["Bucket", "BUCKET_NAMES", "buckets_for_resolution", "choose_bucket", "cover_scale", "fit_to_bucket",
           "shrink_rule", "refit", "resize_pixels"]

BUCKET_NAMES: tuple[str, ...] = ("square", "landscape", "portrait")


@dataclass(frozen=True)
class Bucket:
    """One input shape: ``name`` and ``height``×``width`` in pixels."""

    name: str
    height: int
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The per-image array shape, (height, width, 3)."""
        return (self.height, self.width, 3)


def buckets_for_resolution(resolution: int) -> dict[str, Bucket]:
    """The three buckets of a model whose square input is ``resolution`` px.

    Raises ``ValueError`` for a resolution below 8 px.
    """
    if resolution < 8:
        raise ValueError(f"resolution must be at least 8 px, got {resolution}")
    long_side = resolution * 4 // 3
    return {
        "square": Bucket("square", resolution, resolution),
        "landscape": Bucket("landscape", resolution, long_side),
        "portrait": Bucket("portrait", long_side, resolution),
    }


def choose_bucket(width: int, height: int, buckets: dict[str, Bucket]) -> Bucket:
    """The bucket nearest in log aspect ratio to a ``width``×``height`` image (ties: first)."""
    log_ratio = math.log(width / height)
    return min(buckets.values(), key=lambda b: abs(math.log(b.width / b.height) - log_ratio))


def cover_scale(width: int, height: int, bucket: Bucket, crop_margin: float) -> float:
    """The factor by which ``fit_to_bucket`` scales a ``width``×``height`` image for ``bucket`` (< 1: it shrinks)."""
    return crop_margin * max(bucket.width / width, bucket.height / height)


def shrink_rule(buckets: dict[str, Bucket], crop_margin: float, oversample: float):
    """The decoder's shrink rule (``rampart.inputs.decoding.ShrinkRule``) for a model with these ``buckets``.

    For an upright ``width``×``height`` image it gives the largest factor by which the
    decoded frame may be shrunk while ``fit_to_bucket``'s crop box for the image's
    bucket still spans at least ``oversample`` source pixels per output pixel on each
    axis: ``1 / (oversample · cover_scale)``. With ``oversample`` 1 the final resize
    only ever shrinks (by less than 2× after a DCT or box shrink), never enlarges what
    the file holds. Portrait and landscape buckets are each other's transpose, so
    the factor is the same for a photo stored sideways with an EXIF rotation.
    """
    def rule(width: int, height: int) -> float:
        return 1.0 / (oversample * cover_scale(width, height, choose_bucket(width, height, buckets), crop_margin))
    return rule


def refit(pixels: np.ndarray, target: Bucket) -> np.ndarray:
    """``pixels`` (uint8 H×W×3, already centre-cropped to a bucket of ``target``'s name) resized to ``target``.

    Buckets of one name share their aspect ratio (to rounding), so no crop is
    needed: the same view of the image, resized (``resize_pixels``). The very same
    array is returned when it already has ``target``'s shape.
    """
    if pixels.shape == target.shape:
        return pixels
    return resize_pixels(pixels, target)


def fit_to_bucket(image: Image.Image, bucket: Bucket, crop_margin: float) -> np.ndarray:
    """Scale ``image`` to cover ``bucket`` × ``crop_margin`` and centre-crop it.

    The crop box is computed in source coordinates (rounded to whole pixels) and
    only that region is resized (``resize_pixels``), so no enlarged intermediate
    image is ever made.

    Args:
        image: an RGB ``PIL.Image`` of any size.
        bucket: the target shape.
        crop_margin: ≥ 1; 1.14 keeps the central 1/1.14 ≈ 87.5% (timm's crop_pct).

    Returns:
        ``np.ndarray`` of dtype uint8 and shape (bucket.height, bucket.width, 3).
    """
    if image.mode != "RGB":
        raise ValueError(f"fit_to_bucket needs an RGB image, got mode {image.mode!r}")
    src_w, src_h = image.size
    scale = cover_scale(src_w, src_h, bucket, crop_margin)
    box_w, box_h = bucket.width / scale, bucket.height / scale
    left, top = round((src_w - box_w) / 2), round((src_h - box_h) / 2)
    right, bottom = max(left + 1, round(left + box_w)), max(top + 1, round(top + box_h))
    return resize_pixels(np.asarray(image, dtype=np.uint8)[top:bottom, left:right], bucket)


def resize_pixels(pixels: np.ndarray, bucket: Bucket) -> np.ndarray:
    """uint8 H×W×3 ``pixels`` resized to ``bucket`` (OpenCV): area averaging to shrink, bicubic to enlarge.

    OpenCV's resize costs about a tenth of Pillow's for the same sizes
    (docs/decoding.md); area averaging is its anti-aliased filter for shrinking (here by
    less than 2× after the decoder's shrink, by any factor elsewhere).
    """
    shrinking = pixels.shape[1] > bucket.width or pixels.shape[0] > bucket.height
    out = cv2.resize(np.ascontiguousarray(pixels), (bucket.width, bucket.height),
                     interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC)
    return out
