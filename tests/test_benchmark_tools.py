"""Pure helpers of the benchmark scripts (no cluster)."""
from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_idle_gaps_are_the_window_minus_the_union_of_busy_spans():
    gaps = load("rollout_gaps").idle_gaps
    spans = [(2.0, 3.0), (0.0, 1.5), (2.5, 4.0), (6.0, 9.0)]  # unsorted, overlapping, one beyond the window
    assert gaps(spans, 1.0, 8.0) == [(1.5, 2.0), (4.0, 6.0)]
    assert gaps([], 1.0, 2.0) == [(1.0, 2.0)]
    assert gaps([(0.0, 1.0)], 1.0, 3.0) == [(1.0, 3.0)]


def test_gap_report_classes_gaps_by_the_driver_state_before_them():
    tools = load("rollout_gaps")
    turns = [(0.0, 8, 0, 1, 2), (1.0, 0, 3, 2, 2)]  # (time, capacity, groups on the instance, version, newest)
    text = tools.report([(0.5, 0.52), (1.5, 1.6)], turns, window=2.0)
    assert "| cap>0 running=0 inst_old | 1.0% | 1 | 20.0 |" in text
    assert "| cap0 running>0 inst_new | 5.0% | 1 | 100.0 |" in text
    assert "idle 6.0% in 2 gaps" in text


def test_task_overhead_table_sums_the_processes_and_compares_each_shape_with_the_pipelines():
    table = load("task_overhead").table
    run = {"driver + scheduler": 10.0, "rollout instances": 4.0, "reward/advantage": 5.0, "trainer": 1.0, "wall": 12.0,
           "groups per scoring task": 3.0}
    half = {k: v / 2 for k, v in run.items()}
    text = table({"pipeline": [run, run], "scoring per group": [half, run]})
    pipeline, per_group = text.splitlines()[2], text.splitlines()[3]
    assert pipeline.startswith("| pipeline | 3.0 |") and per_group.startswith("| scoring per group | 2.2 |")
    assert "| 20.0 (20.0 / 20.0) |" in pipeline and pipeline.endswith("| 1.00x |")
    assert "| 15.0 (10.0 / 20.0) |" in per_group and per_group.endswith("| 0.75x |")


def test_handover_hops_follow_each_batchs_last_scored_group():
    hops = load("handover_hops")
    clock = hops.DriverClock()
    clock.rolled = {1: 10.010, 2: 10.100}
    clock.scoring_submitted = {1: 10.011, 2: 10.100}
    clock.scored = {1: 10.040, 2: 10.130}
    clock.updates = {0: (10.140, [1, 2])}  # group 2 was scored last: the update waited for it
    rows = hops.batch_hops(clock, rollout_end={1: 10.0, 2: 10.090}, update_start={0: 10.200},
                           previous_end={0: 10.150})
    assert [round(1000 * x, 3) for x in rows[0]] == [10.0, 0.0, 30.0, 10.0, 10.0, 50.0]
    text = hops.table(rows * 3)  # the first 2 updates are left out as warm-up
    assert "| -> update starts | 50.0 | 50.0 |" in text
    assert text.endswith("| total, rollout end -> update starts | 110.0 | 110.0 |")


def test_speed_ups_are_given_in_tokens_and_in_trajectories_so_longer_responses_cannot_hide_in_tokens_per_s():
    tools = load("compare_modes")
    shape = "1 rollout x 16 slots + 1 trainer"

    def run(mode, tokens_per_s, step_s, tokens):
        return {"mode": mode, "repeat": 0, "shape": shape, "throughput_tokens_per_s": tokens_per_s,
                "step_time_s": step_s, "trained_trajectories": 1000, "consumed_tokens": tokens,
                "max_staleness": 0, "c1_violations": 0, "accuracy": {}, "accuracy_curve": []}

    # K=3 reports 2.5x the tokens/s, but its responses grew by a quarter: per trajectory it is 2x
    runs = [run("sync K=0", 1000.0, 0.4, 30_000), run("DORA K=3", 2500.0, 0.2, 37_500)]
    tools.finish_runs(runs, target=0.5, n=20)
    k3 = runs[1]
    assert k3["speedup"] == 2.5 and k3["speedup_steps"] == 2.0
    assert k3["tokens_per_trajectory"] == 37.5 and runs[0]["tokens_per_trajectory"] == 30.0
    row = tools.aggregate(runs)[1]
    assert row["speedup_steps_text"] == "2.00x (2.00)"
    assert "| 37.5 |" in tools.table([row])


def test_time_to_target_is_the_median_over_runs_with_a_run_that_never_reached_it_counted_as_never():
    tools = load("compare_modes")

    def run(mode, repeat, curve):
        return {"mode": mode, "repeat": repeat, "shape": "s", "throughput_tokens_per_s": 1.0, "step_time_s": 1.0,
                "trained_trajectories": 1, "consumed_tokens": 1, "max_staleness": 0, "c1_violations": 0,
                "accuracy": {}, "accuracy_curve": [{"update": u, "wall_s": t, "accuracy": a} for u, t, a in curve]}

    runs = [run("TRL", 0, [(0, 0.0, 0.2), (40, 8.8, 0.36), (50, 9.5, 0.30)]),  # reached, then fell back: 8.8 s
            run("TRL", 1, [(0, 0.0, 0.2), (120, 30.0, 0.34)]),                   # never reached
            run("TRL", 2, [(0, 0.0, 0.2), (50, 8.0, 0.3515625)]),                # exactly 90/256
            run("DORA", 0, [(0, 0.0, 0.2), (40, 4.5, 0.36)]),
            run("DORA", 1, [(0, 0.0, 0.2), (100, 14.3, 0.36)])]
    tools.finish_runs(runs, target=0.3515, n=120)
    trl, dora = tools.aggregate(runs)
    assert trl["time_to_target_text"] == "8.8 (8.8 / - / 8.0)" and trl["time_to_target_s"] == 8.8
    assert dora["time_to_target_text"] == "9.4 (4.5 / 14.3)"
    runs[2]["time_to_target_s"] = None  # two of three never: the median is "never"
    assert tools.aggregate(runs)[0]["time_to_target_text"] == "not reached (8.8 / - / -)"
    assert "| 9.4 (4.5 / 14.3) |" in tools.table([dora])
