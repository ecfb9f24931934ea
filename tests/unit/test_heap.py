"""``rampart.heap.IdleTrim``: a runner gives its freed C heap back once, when it goes idle after work."""

from __future__ import annotations

import numpy as np

from rampart.heap import IdleTrim, release_heap


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_trims_once_at_the_end_of_each_busy_period_and_never_while_busy_or_idle():
    clock, released = _Clock(), []
    trim = IdleTrim(2.0, release=lambda: released.append(clock.now), clock=clock)
    clock.now += 10
    assert not trim.check()  # idle since the start: nothing to give back
    for _ in range(5):  # a batch every second: busy
        trim.worked()
        clock.now += 1.0
        assert not trim.check()
    clock.now += 1.0  # two seconds since the last batch
    assert trim.check() and released == [116.0]
    clock.now += 30
    assert not trim.check()  # still idle: no second trim
    trim.worked()
    clock.now += 1.99
    assert not trim.check()
    clock.now += 0.01
    assert trim.check() and trim.trims == 2 and released == [116.0, 148.0]


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_a_trim_gives_back_the_holes_freed_memory_leaves_in_the_heap():
    """The real glibc: 96 MiB of small blocks (under the mmap threshold), every eighth kept, the rest freed. The
    freed blocks stay resident between the kept ones until ``release_heap`` trims."""
    release_heap()
    blocks = [np.ones(64 << 10, dtype=np.uint8) for _ in range(1536)]
    kept = blocks[::8]
    del blocks
    before = _rss_mib()
    trim = IdleTrim(0.0)
    trim.worked()
    assert trim.check()
    after = _rss_mib()
    assert before - after > 48, (before, after)  # of the 84 MiB freed
    assert len(kept) == 192
