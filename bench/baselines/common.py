"""What both baselines share: the primary model from the BentoML store and naive preprocessing.

The model is exactly Rampart's primary (the ``primary_model`` setting, from
``RAMPART_PRIMARY_MODEL`` like Rampart's own: ``rampart-primary:latest``, EfficientNet-Lite2,
by default), loaded by the runners' own ``inference.stored.load_engine``, so only the
serving differs.
Preprocessing is the usual naive path: full decode, convert to RGB, squash to
260×260. No byte, pixel or deadline handling.
"""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from rampart.results import top_labels


#: Environment variable naming the engine a baseline runs the model on (``torch`` or ``onnx``: a PyTorch
#: model's checked ONNX export); unset, the model's own framework. ``bench.knee_budget`` sets it to the
#: engine Rampart's primary chose, for a baseline on the same engine.
BASELINE_ENGINE_VARIABLE = "RAMPART_BASELINE_ENGINE"


def load_primary(tag: str | None = None):
    """(engine, labels, resolution) of the stored model ``tag`` (default: the ``primary_model`` setting).

    The engine is the one Rampart's runner would use for it by default (PyTorch or ONNX, by the
    model's ``framework`` metadata), or the one ``RAMPART_BASELINE_ENGINE`` names
    (``BASELINE_ENGINE_VARIABLE``). Raises ``bentoml.exceptions.NotFound`` when ``tag`` is not in
    the store, ``ValueError`` for an engine the model cannot run on.
    """
    import bentoml

    from inference.stored import load_engine
    from rampart.config import get_settings

    settings = get_settings()
    stored = bentoml.models.get(tag or settings.primary.model)
    meta = stored.info.metadata
    engine = load_engine(stored, settings.gpu_memory_fraction, engine=os.environ.get(BASELINE_ENGINE_VARIABLE) or None)
    return engine, list(meta["labels"]), int(meta["resolution"])


def naive_pixels(data: bytes | Image.Image, resolution: int) -> np.ndarray:
    """uint8 resolution×resolution×3: full decode (bytes or an opened image), RGB, squash."""
    image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    return np.asarray(image.convert("RGB").resize((resolution, resolution)), dtype=np.uint8)


def answer(probs: np.ndarray, labels: list[str]) -> dict:
    """A ``/classify``-like body, so the load generator reads both the same way."""
    return {"labels": top_labels(probs, labels, 5), "model": {"name": "baseline"}, "degraded_reason": None}
