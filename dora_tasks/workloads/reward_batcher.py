"""Forward batches across concurrent callers: scoring tasks of several groups share one reward-model forward.

A reward worker runs several scoring tasks at once, each in a thread of its own and each with a few groups. Each
task calls `ForwardBatcher.score(items)` and blocks; one thread of the batcher takes the first waiting call, keeps
collecting calls that arrive within `window_s` of it (or until `batch_size` items wait), then runs the model on
their items together, `batch_size` at a time, and hands every caller its own scores back, in order. A forward that
raises fails every call that had items in it; the others go on.

Simplified: a call is never split across windows (a call larger than `batch_size` takes several forwards of its
own window), and the window starts at the first call, so a lone call waits `window_s` at most.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

Item = TypeVar("Item")
HISTORY = 10_000  # forward passes remembered for `history` (a benchmark reads them)


@dataclass
class ForwardBatch:
    """One forward pass: how many items, how many calls they came from, how long it took."""

    size: int
    calls: int
    seconds: float


@dataclass
class Scored:
    """What one call gets back: its scores, in the order of its items, and the forward passes it took part in with
    its own share of each (`shares[i]`: its items in `batches[i]`)."""

    scores: np.ndarray
    batches: list[ForwardBatch]
    shares: list[int]

    @property
    def seconds(self) -> float:
        """This call's share of the forward time (by items), so that shares of one batch add up to its time."""
        return sum(b.seconds * n / b.size for b, n in zip(self.batches, self.shares))


@dataclass
class _Call(Generic[Item]):
    items: list[Item]
    done: threading.Event = field(default_factory=threading.Event)
    scores: list[float] = field(default_factory=list)
    batches: list[ForwardBatch] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)
    error: BaseException | None = None


class ForwardBatcher(Generic[Item]):
    """`forward(items) -> one score per item`, run by one thread over the calls of all threads."""

    def __init__(self, forward: Callable[[list[Item]], Sequence[float]], batch_size: int, window_s: float) -> None:
        if batch_size < 1 or window_s < 0:
            raise ValueError(f"batch_size must be >= 1 and window_s >= 0, got {batch_size} and {window_s}")
        self.forward, self.batch_size, self.window_s = forward, batch_size, window_s
        self.history: deque[ForwardBatch] = deque(maxlen=HISTORY)  # the latest forward passes, in order
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="reward-model-batcher", daemon=True)
        self._thread.start()

    def score(self, items: Sequence[Item]) -> Scored:
        """The scores of `items`, computed in forward passes shared with the calls that arrive alongside."""
        if not self._thread.is_alive():
            raise RuntimeError("the reward-model batcher is closed")
        call = _Call(list(items))
        if not call.items:
            return Scored(np.zeros(0, dtype=np.float32), [], [])
        self._calls.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return Scored(np.asarray(call.scores, dtype=np.float32), call.batches, call.shares)

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join()

    # ---- the batcher's thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (window := self._collect()) is not None:
            self._run(window)
        while True:  # closed: fail what is still queued
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call is not None:
                call.error = RuntimeError("the reward-model batcher is closed")
                call.done.set()

    def _collect(self) -> list[_Call] | None:
        """The first waiting call and those that arrive within `window_s` of it, up to `batch_size` items; None once
        closed (what was collected is still run)."""
        first = self._calls.get()
        if first is None:
            return None
        window, items = [first], len(first.items)
        deadline = time.monotonic() + self.window_s
        while items < self.batch_size:
            try:
                call = self._calls.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if call is None:
                self._calls.put(None)  # stop after this window
                break
            window.append(call)
            items += len(call.items)
        return window

    def _run(self, window: list[_Call]) -> None:
        """Every item of the window, `batch_size` at a time, each call's scores back in order."""
        flat = [(call, item) for call in window for item in call.items]
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start:start + self.batch_size]
            members = list(dict.fromkeys(id(call) for call, _ in chunk))
            begun = time.perf_counter()
            try:
                scores = list(self.forward([item for _, item in chunk]))
                if len(scores) != len(chunk):
                    raise RuntimeError(f"the reward model returned {len(scores)} scores for {len(chunk)} texts")
            except BaseException as exc:  # noqa: BLE001 - handed to every caller of this batch
                for call, _ in chunk:
                    call.error = exc
                scores = [float("nan")] * len(chunk)
            batch = ForwardBatch(len(chunk), len(members), time.perf_counter() - begun)
            self.history.append(batch)
            for (call, _), value in zip(chunk, scores):
                call.scores.append(float(value))
                if not call.batches or call.batches[-1] is not batch:
                    call.batches.append(batch)
                    call.shares.append(0)
                call.shares[-1] += 1
        for call in window:
            call.done.set()
