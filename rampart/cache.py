"""A content-hash LRU cache of answers: a step of the degradation chain.

When both models fail (or are both full), an upload whose exact bytes were
classified before gets that earlier answer, marked ``degraded_reason:
cached_result``. Keys are SHA-256 digests of the upload bytes; values are the
top classes (the most a request may ask for) as two small numpy arrays, which the
garbage collector never has to scan, and the role of the model that produced
them. ``max_entries`` 0 turns the cache off.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

__all__ = ["CachedAnswer", "ResultCache", "content_key"]


def content_key(data: bytes) -> bytes:
    """SHA-256 digest (32 bytes) of the upload bytes."""
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class CachedAnswer:
    """Top classes best first: int32 ``indices`` (k,) and float32 ``scores`` (k,); the ``role``
    ("primary" or "fallback") of the model that answered and the ``bucket`` name."""

    indices: np.ndarray
    scores: np.ndarray
    role: str
    bucket: str


class ResultCache:
    """Least-recently-used map from ``content_key`` to ``CachedAnswer``, ``max_entries`` at most."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, CachedAnswer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> CachedAnswer | None:
        """The answer stored for ``key`` (marking it recently used), or None."""
        answer = self._entries.get(key)
        if answer is not None:
            self._entries.move_to_end(key)
        return answer

    def put(self, key: bytes, answer: CachedAnswer) -> None:
        """Store ``answer`` for ``key``, evicting the least recently used beyond ``max_entries``."""
        if self.max_entries <= 0:
            return
        self._entries[key] = answer
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
