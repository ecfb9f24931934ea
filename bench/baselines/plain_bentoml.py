"""Baseline (b): a plain BentoML service. The same model in one batchable API, default settings.

Run: ``bentoml serve bench.baselines.plain_bentoml:Plain --port P``; the load
generator posts the JPEG to ``/classify`` as the multipart file field ``image``
(BentoML decodes it into a ``PIL.Image``).
"""

from __future__ import annotations

import bentoml
import numpy as np
from PIL import Image

from bench.baselines.common import answer, load_primary, naive_pixels


@bentoml.service(name="plain_baseline")
class Plain:
    """EfficientNet-Lite2 behind BentoML's adaptive batching with its defaults."""

    def __init__(self) -> None:
        self.engine, self.labels, self.resolution = load_primary()

    @bentoml.api(batchable=True)
    def classify(self, image: list[Image.Image]) -> list[dict]:
        batch = np.stack([naive_pixels(item, self.resolution) for item in image])
        return [answer(row, self.labels) for row in self.engine.predict(batch)]
