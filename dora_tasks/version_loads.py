"""Waking the tasks that wait for a rollout instance to hold a version.

A response handed over to an instance continues there only once the instance serves its version (C1); the instance
may still hold an older one, its first group of the new version on its way. The waiting task sleeps on a condition
that every version load of the instance's engine notifies, and asks the server again only after a load, so that a
wait costs no CPU and ends as soon as the version is in. An instance that moved past the response's version does
not come back to it for the response: that one fails at once."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from dora_tasks.core.handover import Continuation, Resumed, VersionMismatch

T = TypeVar("T")


class VersionWaitTimeout(VersionMismatch):
    """A handed-over response waited longer than its limit for the instance to load its version."""


class VersionLeft(VersionMismatch):
    """A handed-over response reached an instance that already serves a newer version than its own: the instance
    drained that version (it changes version only once none of the loaded one runs or waits), so the response is not
    waited for."""


class VersionLoads:
    """A count of the version loads of one instance's engine, with a condition notified on each."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def loaded(self) -> None:
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def wait_past(self, seen: int, timeout_s: float) -> bool:
        """Block until a load after the `seen`-th happened (True) or `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count != seen, max(0.0, timeout_s))

    def watching(self, make_engine: Callable[[], T]) -> Callable[[], T]:
        """`make_engine`, whose engines report their creation and every `load_version` here."""
        def make() -> T:
            engine = make_engine()
            load = engine.load_version

            def load_version(version: int, weights_path: str) -> None:
                try:
                    load(version, weights_path)
                finally:
                    self.loaded()  # a failed load wakes the waiters too: they look and wait again

            engine.load_version = load_version
            self.loaded()
            return engine

        return make


def resume_when_loaded(server, loads: VersionLoads, continuation: Continuation, weights_path: str,
                       wait_s: float, instance: str = "") -> Resumed:
    """`server.resume(continuation)`, once the server holds the continuation's version: asked now, then after each
    load of its engine, until `wait_s` passed (`VersionWaitTimeout`, naming the version and the weight store), or
    until the server serves a newer version (`VersionLeft`: the driver restarts the group at once rather than after
    the whole wait). A `RolloutServer` on an older version takes the resume at once and loads its version when its
    older rows end; the asking again serves servers that refuse it until then."""
    deadline = time.monotonic() + wait_s
    while True:
        seen = loads.count  # read before asking: a load between the question and the wait ends the wait at once
        try:
            return server.resume(continuation, weights_path)
        except VersionMismatch as mismatch:
            if server.version > continuation.version:
                raise VersionLeft(
                    f"response {continuation.request_id!r} sample {continuation.sample_index} of version "
                    f"{continuation.version}: rollout instance {instance or '(this one)'} serves version "
                    f"{server.version} already, having drained version {continuation.version}") from mismatch
            if not loads.wait_past(seen, deadline - time.monotonic()):
                raise VersionWaitTimeout(
                    f"response {continuation.request_id!r} sample {continuation.sample_index} of version "
                    f"{continuation.version} waited {wait_s:g} s for rollout instance {instance or '(this one)'} to "
                    f"load version {continuation.version} from the weight store at {weights_path!r}; it still "
                    f"serves version {server.version}") from mismatch
