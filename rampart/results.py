"""Turning model outputs into API results.

``top_labels`` maps an N×1000 probability row to the ``labels`` list of the API
response; softmax lives here too so both runners normalise outputs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_TOP_K", "softmax", "top_labels"]

#: Most labels a request may ask for (``top_k``).
MAX_TOP_K = 20


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of an N×C float array; returns float32 N×C rows summing to 1."""
    shifted = logits.astype(np.float32) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_labels(probs: np.ndarray, labels: Sequence[str], k: int) -> list[dict]:
    """The ``k`` most probable classes of one 1-D probability vector, highest first.

    Returns ``[{"index": int, "label": str, "score": float}, ...]``. Raises
    ``ValueError`` when ``probs`` and ``labels`` differ in length.
    """
    if probs.shape != (len(labels),):
        raise ValueError(f"probabilities have shape {probs.shape}, labels have length {len(labels)}")
    k = min(k, len(labels))
    top = np.argpartition(-probs, k - 1)[:k]
    top = top[np.argsort(-probs[top], kind="stable")]
    return [{"index": int(i), "label": labels[i], "score": float(probs[i])} for i in top]
