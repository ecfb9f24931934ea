"""What both baselines share: the primary model from the BentoML store and naive preprocessing.

The model is exactly Rampart's primary (``rampart-primary:latest``: EfficientNet-Lite2,
same weights, same ``TorchClassifier`` engine), so only the serving differs.
Preprocessing is the usual naive path: full decode, convert to RGB, squash to
260×260. No byte, pixel or deadline handling.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from rampart.results import top_labels


def load_primary():
    """(engine, labels, resolution) of ``rampart-primary:latest``."""
    import bentoml
    import torch

    from inference.architectures import create_architecture
    from inference.engines import TorchClassifier

    stored = bentoml.models.get("rampart-primary:latest")
    meta = stored.info.metadata
    module = create_architecture(meta["family"], meta["arch"], num_classes=len(meta["labels"]))
    module.load_state_dict(torch.load(stored.path_of("weights.pt"), map_location="cpu", weights_only=True))
    return TorchClassifier(module, meta["mean"], meta["std"]), list(meta["labels"]), int(meta["resolution"])


def naive_pixels(data: bytes | Image.Image, resolution: int) -> np.ndarray:
    """uint8 resolution×resolution×3: full decode (bytes or an opened image), RGB, squash."""
    image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    return np.asarray(image.convert("RGB").resize((resolution, resolution)), dtype=np.uint8)


def answer(probs: np.ndarray, labels: list[str]) -> dict:
    """A ``/classify``-like body, so the load generator reads both the same way."""
    return {"labels": top_labels(probs, labels, 5), "model": {"name": "baseline"}, "degraded_reason": None}
