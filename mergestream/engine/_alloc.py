"""Keep the C allocator from hoarding freed tensor buffers.

glibc raises its mmap threshold dynamically after the first large ``free``; from then on tensor-
sized buffers come from the heap and per-thread arenas, and freed ones stay resident, so peak RSS
of a streaming fold drifts from "a few tensors" upward with fragmentation. Pinning the threshold
(``mallopt(M_MMAP_THRESHOLD, 1 MiB)``) serves every large buffer with its own mapping that is
returned to the OS on free. Our choice; a no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3
_done = False


def pin_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Serve allocations of at least ``nbytes`` with mmap (idempotent). Returns True if applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False
    return _done
