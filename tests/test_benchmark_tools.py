"""Pure helpers of the benchmark scripts (no cluster)."""
from __future__ import annotations

import importlib.util
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
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


def test_migration_trace_splits_the_open_bubble_by_what_each_idle_instance_did(tmp_path):
    import json

    events = [{"t": 0.0, "type": "Published"}, {"t": 10.0, "type": "Published"},
              {"t": 20.0, "type": "Migrate", "group_id": 1, "source": "a", "target": "b"},
              {"t": 30.0, "type": "Load", "instance": "c", "version": 2}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    busy = {"a": [(0.0, 20.0), (40.0, 110.0)], "b": [(0.0, 110.0)], "c": [(0.0, 30.0), (60.0, 110.0)],
            "d": [(0.0, 50.0), (60.0, 110.0)]}
    (tmp_path / "busy.json").write_text(json.dumps({"busy": busy, "last_dispatch": 110.0}))
    text = load("migration_trace").idle_report(str(tmp_path))  # window 10..110 s, 4 instances: 400 s
    assert "window 100 s x 4 instances" in text
    assert "handed responses over (leaver) 5.0%" in text  # a: 20..40
    assert "loaded a version, nothing handed over 7.5%" in text  # c: 30..60
    assert "no load, no move (no work) 2.5%" in text  # d: 50..60


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


def _protocol_data(**changes):
    data = {"workload": {"config": "configs/longtail_bench.yaml", "overrides": ["train.lr=3e-4"], "updates": 20,
                         "eval_every": 5},
            "target": 0.35, "shape": ["rollout.instances=2"], "runs": 3, "seeds": [7, 8, 9],
            "sides": [{"name": "DORA K=3", "kind": "dora", "overrides": ["dora.max_staleness=3"]},
                      {"name": "TRL", "kind": "trl", "trl": {"processes": 2}}]}
    data.update(changes)
    return data


def test_race_protocol_is_read_with_its_sides_and_rejects_what_cannot_run_as_written():
    import pytest

    stats = load("race_stats")
    protocol = stats.parse_protocol(_protocol_data())
    assert [s.kind for s in protocol.sides] == ["dora", "trl"] and protocol.sides[1].trl == {"processes": 2}
    assert protocol.seeds == (7, 8, 9) and protocol.updates == 20
    with pytest.raises(stats.ProtocolError, match="one seed per run"):
        stats.parse_protocol(_protocol_data(seeds=[7, 8]))
    with pytest.raises(stats.ProtocolError, match="seeds must differ"):
        stats.parse_protocol(_protocol_data(seeds=[7, 7, 9]))
    with pytest.raises(stats.ProtocolError, match="sides\\[0\\].kind"):
        stats.parse_protocol(_protocol_data(sides=[{"name": "x", "kind": "deepspeed"}]))
    with pytest.raises(stats.ProtocolError, match="missing key target"):
        stats.parse_protocol({k: v for k, v in _protocol_data().items() if k != "target"})


def test_the_project_protocol_file_is_valid_and_runs_each_side_at_least_eight_times():
    stats = load("race_stats")
    protocol = stats.load_protocol(os.path.join(ROOT, "benchmarks", "race_protocol.yaml"))
    assert protocol.runs >= 8 and len(set(protocol.seeds)) == protocol.runs
    assert {s.kind for s in protocol.sides} == {"dora", "trl"}


def test_interleaved_order_runs_every_side_once_a_round_and_rotates_who_goes_first():
    order = load("race_stats").interleaved_order(3, 4)
    for rnd in range(4):
        assert sorted(side for r, side in order if r == rnd) == [0, 1, 2]
    firsts = [side for i, (r, side) in enumerate(order) if i % 3 == 0]
    assert firsts == [0, 1, 2, 0]
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # round by round, never side by side


def test_bootstrap_interval_holds_the_median_and_an_unreached_run_opens_the_interval():
    stats = load("race_stats")
    values = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0]
    low, high = stats.bootstrap_median_ci(values, resamples=2000, seed=1)
    assert 10.0 <= low <= stats.median(values) <= high <= 17.0 and low < high
    assert stats.bootstrap_median_ci(values, resamples=2000, seed=1) == (low, high)  # seeded
    low_inf, high_inf = stats.bootstrap_median_ci(values[:4] + [math.inf] * 4, resamples=2000, seed=1)
    assert math.isfinite(low_inf) and math.isinf(high_inf)


def test_rank_test_separates_shifted_samples_and_not_identical_ones():
    stats = load("race_stats")
    fast, slow = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, math.inf]
    assert stats.rank_test(fast, slow) < 0.01
    assert stats.rank_test(fast, list(fast)) > 0.9


def test_version_concurrency_reads_the_most_versions_at_once_and_the_share_with_two_or_more():
    concurrency = load("race_stats").version_concurrency
    # v1 on [0, 2], v2 on [1, 3] and [3, 4]: two versions on [1, 2] out of 4 s of generation
    assert concurrency([(0.0, 2.0, 1), (1.0, 3.0, 2), (3.0, 4.0, 2)]) == (2, 0.25)
    assert concurrency([(0.0, 1.0, 1), (1.0, 2.0, 2)]) == (1, 0.0)  # back to back: never two at once
    assert concurrency([(0.0, 4.0, 1), (1.0, 2.0, 1)]) == (1, 0.0)  # one version on two instances


def test_race_summary_keeps_every_pass_counts_unreached_as_never_and_crashed_apart():
    stats = load("race_stats")
    protocol = stats.parse_protocol(_protocol_data())

    def run(side, t, tput, rnd):
        return {"side": side, "round": rnd, "seed": 7 + rnd, "time_to_target_s": t, "throughput_tokens_per_s": tput,
                "load_average": [3.0, 4.0], "max_staleness": 3 if side == "DORA K=3" else 0, "c1_violations": 0,
                "trained_trajectories": 1280, "versions_generating_max": 2, "two_or_more_versions_share": 0.5}

    passes = [run("DORA K=3", 5.0, 900.0, 0), run("TRL", 9.0, 500.0, 0), run("DORA K=3", None, 800.0, 1),
              run("TRL", 8.0, 450.0, 1), {"side": "DORA K=3", "round": 2, "seed": 9, "failed": "CommClosedError",
                                          "time_to_target_s": None, "load_average": [5.0, 5.0]}]
    dora, trl = stats.summarise(passes, protocol, reference="TRL")
    assert (dora["runs"], dora["failed"], dora["reached"]) == (2, 1, 1)
    assert dora["times"] == [5.0, math.inf] and math.isinf(dora["time_to_target_median"])
    assert trl["time_to_target_median"] == 8.5 and trl["tokens_per_s_median"] == 475.0
    assert trl["runs"] == 2 and "p_time_vs_reference" not in trl and 0.0 <= dora["p_time_vs_reference"] <= 1.0
    table = stats.race_table([dora, trl], "TRL")
    assert "| DORA K=3 | 2 (1) | 1 of 2 |" in table and "| 3 | 0 | 0 |" not in table
    assert "crashed: CommClosedError" in stats.passes_table(passes)


def test_the_peer_compared_against_is_the_trl_side_with_the_lowest_median_time_to_target():
    stats = load("race_stats")
    sides = [{"name": "DORA", "kind": "dora"}, {"name": "TRL threads", "kind": "trl"},
             {"name": "TRL processes", "kind": "trl", "trl": {"processes": 2}}]
    protocol = stats.parse_protocol(_protocol_data(sides=sides))
    assert stats.best_peer([], protocol) == "TRL threads"  # nothing measured yet: the first peer

    def run(side, t):
        return {"side": side, "time_to_target_s": t}

    passes = [run("DORA", 1.0), run("TRL threads", 9.0), run("TRL threads", None), run("TRL threads", 7.0),
              run("TRL processes", 8.0), run("TRL processes", 10.0), {"side": "TRL processes", "failed": "x"}]
    assert stats.best_peer(passes, protocol) == "TRL threads"  # median 9.0 (never counts as last) against 9.0: first
    passes.append(run("TRL processes", 8.5))
    assert stats.best_peer(passes, protocol) == "TRL processes"  # median 8.5 against 9.0
    assert stats.best_peer([], stats.parse_protocol(_protocol_data(sides=sides[:1]))) == "DORA"


def test_switching_scale_gives_every_instance_work_and_compares_each_switching_with_its_own_size():
    import pytest

    tools = load("switching_scale")
    args = tools.parse(["--instances", "64", "--slots", "4", "--max-staleness", "3", "--speedup", "20"])
    cfg = tools.make_config(tools.settings(args, 64), "/nonexistent", ["rollout.switching=migrate"])
    assert cfg.dora.rollout_batch_size == 64 * 4 == (3 + 1) * cfg.dora.train_batch_size  # the in-flight cap
    assert cfg.rollout.switching == "migrate" and cfg.emulation.trainer_gpus == 64 * 2
    shares = tools.overheads({"orchestration_cpu_s": 1.0, "emulated_run_s": 1000.0, "migration_s": 640.0}, cfg)
    assert shares["orchestration_share"] == pytest.approx(0.02) and shares["transfer_share"] == pytest.approx(0.01)
    rows = [{"instances": 8, "switching": s, "throughput": t} for s, t in (("drain", 100), ("queue", 120),
                                                                          ("migrate", 150))]
    rows += [{"instances": 16, "switching": "drain", "throughput": 1000}, {"instances": 16, "switching": "m2",
                                                                           "throughput": 900}]
    tools.add_gains(rows)
    assert rows[2]["gain_drain"] == pytest.approx(0.5) and rows[2]["gain_queue"] == pytest.approx(0.25)
    assert rows[4]["gain_drain"] == pytest.approx(-0.1) and "gain_queue" not in rows[4]
    assert "gain_drain" not in rows[0] and "gain_queue" not in rows[1]
    assert [name for name, _ in tools.variants(["m2=rollout.versions_per_instance=2"])][-1] == "m2"
    with pytest.raises(SystemExit, match="NAME="):
        tools.variants(["m2"])
