"""Keep freed memory in the process for the next tensor: glibc's malloc thresholds for the engines' workers.

A Dask nanny starts its worker with ``MALLOC_TRIM_THRESHOLD_=65536`` (`distributed.nanny.pre-spawn-environ`, there so
that memory freed by pandas-style tasks goes back to the OS). Setting any malloc threshold also turns off glibc's
dynamic mmap threshold, so every allocation above 128 KiB becomes an mmap of fresh zeroed pages and a munmap on free:
a PyTorch forward and backward allocates and frees such buffers hundreds of times, so train and decode steps slow
down markedly under the nanny's setting (figures: docs/benchmark.md).

`relax_malloc_trimming()` raises both thresholds at run time (`mallopt`), whatever the worker was started with: an
allocation stays on the heap up to MMAP_THRESHOLD, and the heap is trimmed only when TRIM_THRESHOLD is free at its
top. Worker memory still returns to the OS for larger frees, and Dask's memory limits still apply.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def relax_malloc_trimming() -> bool:
    """Apply the thresholds; False where the C library has no `mallopt` (not glibc) or refuses them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
