"""The server process's C heap: glibc's mmap threshold pinned, so freed large buffers go back to the OS.

glibc serves an allocation of at least the *mmap threshold* (128 KiB at start) with its own
``mmap`` and returns it to the OS on ``free``. But the threshold is dynamic: each time such a
buffer is freed, glibc raises the threshold to its size (up to 32 MiB). After the server has freed
a few large buffers (a 1 MiB request body, a prompt's prefill activations, a KV cache), every later
buffer up to that size comes from the heap instead, between long-lived small allocations; when it is
freed its pages stay with the process, and the next one of a slightly different size often does not
fit the hole. Under the 10-minute soak the heap's free bytes grew without bound and with them RSS
(6.8 MiB a minute); with the threshold pinned they stayed flat (docs/RESULTS.md). Setting the
threshold explicitly switches the dynamic raising off (glibc's ``mallopt``), as the environment
variable ``MALLOC_MMAP_THRESHOLD_`` does; a value set there is left alone.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 64 << 10


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes for this process. True when it was set; False
    without glibc's ``mallopt`` (macOS, musl) or when ``MALLOC_MMAP_THRESHOLD_`` already sets it."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
