"""Low-level zarr helpers of the trajectory store: growing, trimming and span reads of 1-D/2-D arrays, the writer lock.

Kept apart from `trajectory_store.py` so that the store reads as schema + protocol, not as array plumbing.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
from zarr.core.sync import sync  # zarr's own event-loop runner (what every sync zarr call uses)

from storage.schema import StoreLockedError

LOCK_FILE = ".writer.lock"


def local_path(url: Any) -> str | None:
    """The filesystem path of a local store (plain path or file:// URL), None for other fsspec URLs."""
    text = os.fspath(url) if isinstance(url, os.PathLike) else str(url)
    if text.startswith("file://"):
        return text[len("file://"):]
    return None if "://" in text else text


def append_many(jobs: list[tuple[Any, int, np.ndarray]]) -> None:
    """Write each `data` at rows [start, start + len) of its array. An array too short grows its first axis to a
    whole number of chunks (capacity: most flushes then rewrite no metadata) and its second axis, for 2-D, to fit.
    All resizes, then all writes, each set run concurrently on zarr's event loop (a flush touches ~30 arrays and
    each zarr call costs a few ms of overhead)."""
    grow, writes = [], []
    for array, start, data in jobs:
        end = start + len(data)
        shape = list(array.shape)
        capacity = -(-end // array.chunks[0]) * array.chunks[0]
        grown = [shape[0] if shape[0] >= end else capacity] + [max(s, d) for s, d in zip(shape[1:], data.shape[1:])]
        if grown != shape:
            grow.append(array.async_array.resize(tuple(grown)))
        selection = (slice(start, end),) if array.ndim == 1 else (slice(start, end), slice(0, data.shape[1]))
        writes.append((array, selection, data))

    async def run() -> None:
        await asyncio.gather(*grow)  # metadata first: a write beyond the old shape would be clipped
        await asyncio.gather(*(a.async_array.setitem(sel, d) for a, sel, d in writes))

    sync(run())


def trim_many(jobs: list[tuple[Any, int]]) -> None:
    """Shrink each array to its row count (arrays already that short are left alone). The kept partial chunk's tail
    is reset to the fill value first: zarr keeps the bytes of a partial chunk on resize, so without this a later grow
    would resurrect the dropped rows. Runs concurrently, like `append_many`."""
    jobs = [(array, n) for array, n in jobs if array.shape[0] > n]
    resets = []
    for array, n in jobs:
        chunk = array.chunks[0]
        stale_end = min(array.shape[0], -(-n // chunk) * chunk)
        if stale_end > n:
            selection = (slice(n, stale_end),) + (slice(None),) * (array.ndim - 1)
            resets.append(array.async_array.setitem(selection, array.fill_value))

    async def run() -> None:
        await asyncio.gather(*resets)
        await asyncio.gather(*(a.async_array.resize((n,) + tuple(a.shape[1:])) for a, n in jobs))

    sync(run())


def read_spans(array: Any, starts: np.ndarray, lengths: np.ndarray, gap: int) -> list[np.ndarray]:
    """Read the spans [starts[i], starts[i] + lengths[i]) of a 1-D array, coalescing spans closer than `gap`
    elements into one read (a zarr read costs about one chunk decode, whatever its size)."""
    out: list[np.ndarray] = [np.zeros(0, dtype=array.dtype)] * len(starts)
    order = np.argsort(starts, kind="stable")
    i = 0
    while i < len(order):
        lo = int(starts[order[i]])
        hi = lo + int(lengths[order[i]])
        j = i + 1
        while j < len(order) and int(starts[order[j]]) <= hi + gap:
            hi = max(hi, int(starts[order[j]]) + int(lengths[order[j]]))
            j += 1
        window = np.asarray(array[lo:hi]) if hi > lo else np.zeros(0, dtype=array.dtype)
        for k in order[i:j]:
            s = int(starts[k]) - lo
            out[k] = window[s: s + int(lengths[k])].copy()
        i = j
    return out


class WriterLock:
    """An exclusive `flock` on `<store>/.writer.lock` (local stores only; released when the process dies)."""

    def __init__(self, store_dir: str):
        import fcntl

        self._path = os.path.join(store_dir, LOCK_FILE)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise StoreLockedError(f"{store_dir} is open for writing in another process (lock {self._path}); "
                                   "the store has one writer, the driver") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1
