"""Waiting in tests: poll a condition until a deadline, and fail with what was awaited instead of sleeping a guess."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """Poll `predicate` until it returns something truthy, and return that; AssertionError naming `what` (the
    condition, as a phrase: "the update was sent back to the scheduler") if `timeout_s` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting until {what}")
        time.sleep(interval_s)
