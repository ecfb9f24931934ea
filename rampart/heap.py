"""The C heap of a process: what glibc keeps of freed memory, and giving it back.

Both functions are glibc's (Linux); elsewhere they do nothing and say so.

- ``release_heap``: a runner trims its heap once after warm-up, whose large batches
  left freed memory behind.
- ``IdleTrim``: a runner trims its heap again once it goes idle after work: the larger
  adaptive batches of an overload leave freed memory behind as the warm-up's did.
- ``keep_freed_heap``: a decode worker keeps a few MiB of freed heap for the next
  upload. With glibc's defaults, each decode's frames (a 260×260 RGB frame is
  270 KB in Pillow's 4-byte pixels) were mapped fresh and returned at the end:
  160 page faults per decode of a 260×260 PNG in a decode worker, about 10% of
  its CPU (docs/decoding.md, "The decode worker's heap").
"""

from __future__ import annotations

import ctypes
import threading
import time

__all__ = ["release_heap", "keep_freed_heap", "IdleTrim"]

#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (both must exist: glibc, not musl)
        return libc
    except (OSError, AttributeError):
        return None


def release_heap() -> None:
    """Return the C heap's free memory to the operating system (glibc ``malloc_trim(0)``; no-op elsewhere).

    glibc keeps freed memory of large temporary buffers (warm-up batches) in the process;
    trimming after warm-up leaves the resident size at what serving needs.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_freed_heap(keep_bytes: int) -> bool:
    """Let this process keep up to ``keep_bytes`` of freed C heap instead of returning it at once.

    Sets glibc's trim threshold to ``keep_bytes`` (free memory at the heap's top beyond it
    goes back to the system) and its mmap threshold to half of it (smaller blocks come
    from the heap, larger ones are mapped and unmapped as before, so a large frame's
    memory still goes back when it is freed). Fixed thresholds replace glibc's dynamic
    ones for this process. So what the process retains is bounded by about ``keep_bytes``
    plus the heap's fragmentation. ``keep_bytes`` ≤ 0 changes nothing.

    Returns whether the thresholds were set (False off glibc or for ``keep_bytes`` ≤ 0).
    """
    libc = _glibc()
    if libc is None or keep_bytes <= 0:
        return False
    mapped_from = max(keep_bytes // 2, 128 << 10)  # glibc's own default threshold is 128 KiB
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mapped_from)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, keep_bytes))


class IdleTrim:
    """Return the C heap's free memory to the system once a process has been idle for ``idle_s`` after work.

    ``worked()`` (one clock read and two stores: call it after each unit of work, a runner's batch) marks the
    process busy. ``check()`` trims (``release``, by default ``release_heap``) when work was marked since the last
    trim and none for ``idle_s`` seconds; ``start()`` runs ``check()`` every ``idle_s / 2`` seconds on a daemon
    thread. So a server trims once at the end of each busy period (an overload's larger batches leave freed
    memory in glibc's arenas, which it keeps), never while busy, and not again while it stays idle. ``trims``
    counts the trims. ``idle_s`` ≤ 0: ``start()`` does nothing.

    Cost: the trim runs off the serving threads; a batch that starts meanwhile may wait for an arena's lock, and
    its first run faults in again what was given back (a few ms of CPU on the 2-core host).
    """

    def __init__(self, idle_s: float, release=release_heap, clock=time.monotonic) -> None:
        self.idle_s = float(idle_s)
        self.trims = 0
        self._release, self._clock = release, clock
        self._last_work = 0.0
        self._dirty = False

    def worked(self) -> None:
        """Mark that work was just done."""
        self._last_work = self._clock()
        self._dirty = True

    def check(self) -> bool:
        """Trim when work was done since the last trim and none for ``idle_s``; returns whether it trimmed."""
        if not self._dirty or self._clock() - self._last_work < self.idle_s:
            return False
        self._dirty = False
        self._release()
        self.trims += 1
        return True

    def start(self) -> None:
        """Check every ``idle_s / 2`` seconds on a daemon thread, for the life of the process."""
        if self.idle_s <= 0:
            return

        def loop() -> None:
            while True:
                time.sleep(self.idle_s / 2)
                self.check()

        threading.Thread(target=loop, name="rampart-idle-heap-trim", daemon=True).start()
