"""Turning model outputs into API results.

``top_labels`` maps an N×1000 probability row to the ``labels`` list of the API
response; softmax lives here too so both runners normalise outputs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_TOP_K", "softmax", "top_classes", "label_entries", "top_labels"]

#: Most labels a request may ask for (``top_k``).
MAX_TOP_K = 20


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of an N×C float array; returns float32 N×C rows summing to 1."""
    shifted = logits.astype(np.float32) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def top_classes(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable classes of a 1-D probability vector, highest first.

    Returns (int32 indices (k,), float32 scores (k,)); ``k`` is capped at the vector's length.
    """
    k = min(k, probs.shape[0])
    top = np.argpartition(-probs, k - 1)[:k]
    top = top[np.argsort(-probs[top], kind="stable")]
    return top.astype(np.int32), probs[top].astype(np.float32)


def label_entries(indices: np.ndarray, scores: np.ndarray, labels: Sequence[str]) -> list[dict]:
    """API ``labels`` entries: ``[{"index": int, "label": str, "score": float}, ...]`` in the given order."""
    return [{"index": int(i), "label": labels[i], "score": float(p)} for i, p in zip(indices, scores)]


def top_labels(probs: np.ndarray, labels: Sequence[str], k: int) -> list[dict]:
    """The ``k`` most probable classes of one 1-D probability vector, highest first.

    Returns ``[{"index": int, "label": str, "score": float}, ...]``. Raises
    ``ValueError`` when ``probs`` and ``labels`` differ in length.
    """
    if probs.shape != (len(labels),):
        raise ValueError(f"probabilities have shape {probs.shape}, labels have length {len(labels)}")
    return label_entries(*top_classes(probs, k), labels)
