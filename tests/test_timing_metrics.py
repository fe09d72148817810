"""The timing metrics of the design, as pure functions over recorded timestamps."""
from __future__ import annotations

import math

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


def test_the_open_bubble_splits_into_idle_while_the_gate_held_dispatch_and_idle_while_it_admitted_groups():
    tl = timeline([10.0, 20.0, 30.0, 40.0])  # steady window 20 -> 40, open until the last dispatch at 36
    tl.gate_state(18.0, closed=True)
    tl.gate_state(24.0, closed=False)  # held 20 -> 24 within the window
    tl.gate_state(33.0, closed=True)  # still closed at the end: held 33 -> 36
    busy = {"a": [(0.0, 22.0), (25.0, 40.0)], "b": [(0.0, 30.0)]}
    m = summary(tl, busy, last_dispatch=36.0)
    # a idles 22-25 (2 s held, 1 s free); b idles 30-36 (3 s held, 3 s free); window 16 s
    assert m["open_rollout_bubble"] == pytest.approx((3 + 6) / 32)
    assert m["open_rollout_bubble_held"] == pytest.approx((2 + 3) / 32)
    assert m["open_rollout_bubble_free"] == pytest.approx((1 + 3) / 32)
    assert m["gate_closed_share"] == pytest.approx((4 + 3) / 16)
    tl.gate_state(38.0, closed=False)
    assert tl.closed_spans(40.0) == [(18.0, 24.0), (33.0, 38.0)]


def test_the_driver_reaction_lag_counts_what_the_driver_acted_on_in_the_steady_window():
    tl = Timeline(0.0)
    lags = {0: [4.0], 1: [9.0], 2: [1.0, 3.0], 3: [2.0]}  # acted on before each publish: 0 and 1 are the warm-up
    for i, published in enumerate([10.0, 20.0, 30.0, 40.0]):
        for lag in lags[i]:
            tl.react("RolloutTask", lag)
        tl.react("UpdateTask", 0.5)
        tl.add(UpdateTiming(i, published - 1.0, published - 1.0, published - 0.5, published, 100))
    tl.react("RolloutTask", 50.0)  # after the last publish: outside the window
    m = summary(tl, {"a": [(0.0, 40.0)]})
    assert m["driver_reaction_lag_mean_s"] == pytest.approx((1 + 3 + 2 + 0.5 + 0.5) / 5)
    assert m["driver_reaction_lag_max_s"] == 3.0
    assert m["driver_reaction_lag_step_share"] == pytest.approx(1.4 / 10.0)
    assert m["driver_trainer_lag_share"] == pytest.approx(1.0 / 20.0)  # two updates' reactions over the window
    assert math.isnan(summary(timeline([10.0, 20.0, 30.0]), {"a": [(0.0, 30.0)]})["driver_reaction_lag_mean_s"])


def test_streamed_parts_are_counted_over_the_steady_updates_that_had_parts():
    parts = {0: ((1.0, 2.0, 1), (3.0, 4.0, 1), (5.0, 6.0, 1)), 1: (), 2: ((20.0, 22.0, 3), (24.0, 25.0, 1)),
             3: ((30.0, 33.0, 4),)}  # 0 and 1 are the warm-up; 1 was not streamed
    tl = Timeline(0.0)
    for i, published in enumerate([10.0, 20.0, 30.0, 40.0]):
        tl.add(UpdateTiming(i, published - 1.0, published - 1.0, published - 0.5, published, 100, parts=parts[i]))
    m = summary(tl, {"a": [(0.0, 40.0)]})
    assert m["trainer_parts_per_update"] == pytest.approx((2 + 1) / 2)
    assert m["first_part_group_share"] == pytest.approx((3 / 4 + 4 / 4) / 2)
    assert math.isnan(summary(timeline([10.0, 20.0, 30.0]), {"a": [(0.0, 30.0)]})["trainer_parts_per_update"])
