"""What one decode worker does for one upload: encoded bytes in, one model's bucket-sized uint8 array out.

``prepare(data, plan)`` runs in a decode worker (a process by default, see
``rampart.inputs.pool``), so everything it takes and returns is small and picklable:
the upload's bytes and a ``DecodePlan`` (sent once per worker: ``BoundedPool.share``)
go in; a ``Prepared`` with the content key and the input of one model comes back
(260×346×3 uint8, 270 KB, at most, for the default models).

The frame is decoded at the cost of the pixels the model needs, not of the file:
the plan's shrink rule (``rampart.inputs.buckets.shrink_rule``) lets a JPEG be
decoded at 1/2, 1/4 or 1/8 scale in the DCT domain and any frame be box-reduced,
as far as the bucket still gets ``oversample`` source pixels per output pixel. Only
the model with the largest input (the *base* role: the primary, by default) gets
its array here; another model's input is made from that array when, and only if,
that model is called (``model_input``): one resize of a 270 KB array instead of a
second resize of the decoded frame on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from PIL import Image

from rampart.cache import content_key
from rampart.faults import FaultInjector, FaultSpec
from rampart.inputs.buckets import Bucket, choose_bucket, fit_to_bucket, refit, shrink_rule
from rampart.inputs.decoding import DecodeLimits, decode_image, relax_metadata_limits

__all__ = ["DecodePlan", "Prepared", "prepare", "model_input", "DEFAULT_OVERSAMPLE"]

# The decode pool's forkserver imports this module once; loading every Pillow plugin
# here means no worker, new or replaced, pays for it on its first upload.
Image.init()

#: Source pixels per output pixel (on each axis) the decoded frame keeps at least; 1.0 measured enough
#: (``bench.decode_agreement``: top-1 of both default models against the full-size decode, docs/decoding.md).
DEFAULT_OVERSAMPLE = 1.0


@dataclass(frozen=True)
class DecodePlan:
    """How to prepare an upload: decode ``limits``, the buckets of each model by role
    ("primary", "fallback"), the ``crop_margin`` (see ``fit_to_bucket``), the decode-hang
    fault (``fault_decode_hang`` setting, overridden by ``fault_file``) and ``oversample``
    (``decode_oversample`` setting: source pixels per output pixel kept, ≥ 1)."""

    limits: DecodeLimits
    buckets: dict[str, dict[str, Bucket]]
    crop_margin: float
    fault_hang: bool = False
    fault_file: str = ""
    oversample: float = DEFAULT_OVERSAMPLE

    @cached_property
    def base_role(self) -> str:
        """The role whose input the worker makes: the one with the largest bucket (ties: the first listed)."""
        return max(self.buckets, key=lambda role: max(b.height * b.width for b in self.buckets[role].values()))


@dataclass(frozen=True)
class Prepared:
    """A decoded upload: its content ``key`` (SHA-256, 32 bytes), Pillow ``format``, the header's
    ``declared_size`` (width, height px), the ``base`` role, per role its bucket and uint8 H×W×3
    pixels (the base role's from the worker; others are added by ``model_input``), and the
    decoder's ``warnings`` about benign damage it accepted (strings; may be empty)."""

    key: bytes
    format: str
    declared_size: tuple[int, int]
    inputs: dict[str, tuple[Bucket, np.ndarray]]
    warnings: tuple[str, ...] = field(default=())
    base: str = "primary"


def prepare(data: bytes, plan: DecodePlan, role: str | None = None) -> Prepared:
    """Decode ``data`` within ``plan.limits``, shrunk as far as ``role``'s bucket allows, and fit it there.

    ``role`` (a key of ``plan.buckets``): the model about to run; default ``plan.base_role``
    (the model with the largest input), whose array the other model's input can be made from.
    The returned ``Prepared.base`` is that role. Raises what
    ``rampart.inputs.decoding.decode_image`` raises (``ImageError`` subclasses only). Under the
    decode-hang fault it first blocks until the fault ends.
    """
    FaultInjector("decode", FaultSpec(hang=plan.fault_hang), plan.fault_file).hold_while_hung()
    relax_metadata_limits(plan.limits.max_body_bytes)
    role = role or plan.base_role
    buckets = plan.buckets[role]
    decoded = decode_image(data, plan.limits, shrink_rule(buckets, plan.crop_margin, plan.oversample))
    bucket = choose_bucket(*decoded.upright_size, buckets)
    pixels = fit_to_bucket(decoded.image, bucket, plan.crop_margin)
    return Prepared(content_key(data), decoded.format, decoded.declared_size, {role: (bucket, pixels)},
                    tuple(str(w) for w in getattr(decoded, "warnings", ())), role)


def model_input(prepared: Prepared, role: str, buckets: dict[str, Bucket]) -> tuple[Bucket, np.ndarray]:
    """``role``'s (bucket, uint8 H×W×3) input for ``prepared``, made from the base role's array on first use.

    The bucket has the base bucket's name (``buckets`` are that model's); the pixels
    are the base array resized (``rampart.inputs.buckets.refit``), or the same array
    when the shapes match. Kept in ``prepared.inputs``, so it is made at most once.
    """
    made = prepared.inputs.get(role)
    if made is None:
        base_bucket, pixels = prepared.inputs[prepared.base]
        target = buckets[base_bucket.name]
        made = prepared.inputs[role] = (target, refit(pixels, target))
    return made
