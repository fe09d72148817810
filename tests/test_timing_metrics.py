"""The timing metrics of the design, as pure functions over recorded timestamps."""
from __future__ import annotations

import pytest

from pipelines.metrics import Timeline, UpdateTiming, summary


def timeline(publishes: list[float]) -> Timeline:
    tl = Timeline(0.0)
    for i, published in enumerate(publishes):
        tl.updates.append(UpdateTiming(i, published - 1.0, published - 1.0, published - 0.5, published, 100))
    return tl


def test_the_open_bubble_ends_at_the_last_dispatch_and_the_rollout_bubble_at_the_last_publish():
    tl = timeline([10.0, 20.0, 30.0, 40.0])  # steady window 20 -> 40
    busy = {"a": [(0.0, 32.0)], "b": [(0.0, 26.0)]}  # both idle once the last group (dispatched at 30) ends
    m = summary(tl, busy, last_dispatch=30.0)
    assert m["rollout_bubble"] == pytest.approx(1 - (12 + 6) / 40)
    assert m["open_rollout_bubble"] == pytest.approx(1 - (10 + 6) / 20) and m["open_window_s"] == 10.0
    assert summary(tl, busy)["open_rollout_bubble"] == pytest.approx(m["rollout_bubble"])  # no dispatch time: whole window
