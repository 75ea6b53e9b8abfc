"""glibc's allocator settings for a training process (imports nothing heavy, so a test can
check them in a clean child process)."""

from __future__ import annotations

import ctypes


def keep_freed_memory() -> bool:
    """Ask glibc to serve large allocations from its heap and keep what a step frees, instead of
    mapping fresh pages for each (above 32 MB it maps every allocation and unmaps it when freed).
    A training step allocates and frees large tensors every time, and faulting fresh pages in for
    them can cost more than the forward itself. Where it runs: CPU training under glibc. False
    where it cannot (another libc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
