"""``rampart.cache``: the result cache is LRU-bounded and can be off."""

from __future__ import annotations

import numpy as np

from rampart.cache import CachedAnswer, ResultCache, content_key


def test_cache_is_lru_bounded_and_can_be_off():
    cache = ResultCache(2)
    keys = [content_key(bytes([i])) for i in range(3)]
    for key in keys:
        cache.put(key, CachedAnswer(np.array([3], np.int32), np.array([0.5], np.float32), "primary", "square"))
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) is not None
    off = ResultCache(0)
    off.put(keys[0], CachedAnswer(np.zeros(0, np.int32), np.zeros(0, np.float32), "fallback", "square"))
    assert off.get(keys[0]) is None
