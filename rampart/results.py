"""Turning model outputs into API results.

``top_labels`` maps an N×1000 probability row to the ``labels`` list of the API
response; softmax lives here too so both runners normalise outputs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_TOP_K", "CONFIDENCE_KINDS", "softmax", "top_classes", "label_entries", "top_labels", "confidences"]

#: Most labels a request may ask for (``top_k``).
MAX_TOP_K = 20

#: How sure a model is of its top-1 answer (``confidences``): ``msp``, the maximum softmax
#: probability, the exit rule of "Wisdom of Committees" (Wang et al., ICLR 2022); ``margin``,
#: top-1 minus top-2 probability, as in margin sampling (Scheffer et al., IDA 2001).
CONFIDENCE_KINDS: tuple[str, ...] = ("msp", "margin")


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


def confidences(probs: np.ndarray) -> dict[str, np.ndarray]:
    """Both confidence measures (``CONFIDENCE_KINDS``) of a float32 N×C probability array.

    Returns ``{"msp": float32 (N,), "margin": float32 (N,)}``, each in [0, 1]. The cascade
    (``rampart.pipeline``) and its calibration (``bench.cascade_eval``) both use this.
    """
    top2 = -np.partition(-probs, 1, axis=1)[:, :2]
    return {"msp": top2[:, 0].astype(np.float32), "margin": (top2[:, 0] - top2[:, 1]).astype(np.float32)}
