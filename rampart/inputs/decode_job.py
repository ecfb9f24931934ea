"""What one decode worker does for one upload: encoded bytes in, bucket-sized uint8 arrays out.

``prepare(data, plan)`` runs in a decode worker (a process by default, see
``rampart.inputs.pool``), so everything it takes and returns is small and picklable:
the upload's bytes and a ``DecodePlan`` go in; a ``Prepared`` with the content
key and one array per model comes back (260×346×3 + 224×298×3 uint8, about
0.5 MB, at most). No decoded image ever leaves the worker: the inputs of both
models are fitted here, so the fallback needs no second trip to the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from rampart.inputs.buckets import Bucket, choose_bucket, fit_to_bucket
from rampart.cache import content_key
from rampart.inputs.decoding import DecodeLimits, decode_image
from rampart.faults import FaultInjector, FaultSpec

__all__ = ["DecodePlan", "Prepared", "prepare", "working_copy"]

# The decode pool's forkserver imports this module once; loading every Pillow plugin
# here means no worker, new or replaced, pays for it on its first upload.
Image.init()


@dataclass(frozen=True)
class DecodePlan:
    """How to prepare an upload: decode ``limits``, the buckets of each model by role
    ("primary", "fallback"), the ``crop_margin`` (see ``fit_to_bucket``) and the decode-hang
    fault (``fault_decode_hang`` setting, overridden by ``fault_file``)."""

    limits: DecodeLimits
    buckets: dict[str, dict[str, Bucket]]
    crop_margin: float
    fault_hang: bool = False
    fault_file: str = ""


@dataclass(frozen=True)
class Prepared:
    """A decoded upload: its content ``key`` (SHA-256, 32 bytes), Pillow ``format``, the header's
    ``declared_size`` (width, height px), per role its bucket and uint8 H×W×3 pixels, and the
    decoder's ``warnings`` about benign damage it accepted (strings; may be empty)."""

    key: bytes
    format: str
    declared_size: tuple[int, int]
    inputs: dict[str, tuple[Bucket, np.ndarray]]
    warnings: tuple[str, ...] = field(default=())


def prepare(data: bytes, plan: DecodePlan) -> Prepared:
    """Decode ``data`` within ``plan.limits`` and fit it to each role's nearest bucket.

    Raises what ``rampart.inputs.decoding.decode_image`` raises (``ImageError`` subclasses
    only). Under the decode-hang fault it first blocks until the fault ends.
    """
    FaultInjector("decode", FaultSpec(hang=plan.fault_hang), plan.fault_file).hold_while_hung()
    decoded = decode_image(data, plan.limits)
    image = working_copy(decoded.image, plan.limits.min_decoded_side)
    inputs = {}
    for role, buckets in plan.buckets.items():
        bucket = choose_bucket(*image.size, buckets)
        inputs[role] = (bucket, fit_to_bucket(image, bucket, plan.crop_margin))
    return Prepared(content_key(data), decoded.format, decoded.declared_size, inputs,
                    tuple(str(w) for w in getattr(decoded, "warnings", ())))


def working_copy(image: Image.Image, min_side: int) -> Image.Image:
    """``image`` shrunk by an integer box-filter factor (``Image.reduce``) while its short side stays ≥ ``min_side``.

    Every bucket is smaller than ``min_side``/2, so nothing is lost, and both models'
    inputs are fitted from this smaller copy (≤ 4× ``min_side``² × aspect ratio × 3 bytes).
    """
    factor = min(image.size) // min_side
    return image.reduce(factor) if factor >= 2 else image
