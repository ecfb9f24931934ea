"""``rampart.results``: softmax and the top-k labels of an answer."""

from __future__ import annotations

import numpy as np
import pytest

from rampart.results import softmax, top_labels


def test_top_labels_sorted_and_validated():
    probs = softmax(np.array([[0.1, 3.0, 2.0, -1.0]]))[0]
    assert abs(probs.sum() - 1) < 1e-6
    out = top_labels(probs, ["a", "b", "c", "d"], 3)
    assert [o["label"] for o in out] == ["b", "c", "a"]
    with pytest.raises(ValueError):
        top_labels(probs, ["a"], 1)
