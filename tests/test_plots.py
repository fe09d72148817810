"""Plots: synthetic store tables -> non-trivial PNGs; missing optional columns never break a plot; helper maths."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.image import imread

from pipelines import plots
from synthetic_run import synthetic_tables

K = 2


def assert_real_png(path: str, min_bytes: int = 10_000) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > min_bytes, f"{path}: only {len(data)} bytes"
    image = imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05, f"{path} is nearly uniform"


@pytest.fixture(scope="module")
def tables():
    return synthetic_tables(num_updates=8, K=K)


def test_make_plots_writes_all_four(tables, tmp_path):
    paths = plots.make_plots(tables, str(tmp_path), K)
    assert sorted(p.rsplit("/", 1)[-1] for p in paths) == ["learning.png", "staleness.png", "throughput.png",
                                                            "timeline.png"]
    for path in paths:
        assert_real_png(path)


def test_missing_optional_columns_are_derived_or_left_out(tables, tmp_path):
    upd = {k: v for k, v in tables["updates"].items() if k in ("update", "end")}  # no start, no metrics
    traj = {k: v for k, v in tables["trajectories"].items() if k != "reward"}
    paths = plots.make_plots({"updates": upd, "trajectories": traj}, str(tmp_path), None)
    assert len(paths) == 4
    view = plots.updates_view({"updates": upd, "trajectories": traj}, plots._time_origin({"updates": upd}))
    assert np.isnan(view["reward_mean"]).all() and np.isnan(view["trainer_bubble"]).all()
    assert np.isfinite(view["tokens"]).all() and np.isfinite(view["rollout_bubble"]).all()


def test_store_metric_prefix_and_empty_or_absent_tables(tables, tmp_path):
    upd = dict(tables["updates"])
    upd["metrics/reward_mean"] = upd.pop("reward_mean")
    view = plots.updates_view({"updates": upd}, 0.0)
    np.testing.assert_allclose(view["reward_mean"], tables["updates"]["reward_mean"])
    empty = {name: {col: arr[:0] for col, arr in table.items()} for name, table in tables.items()}
    assert plots.make_plots(empty, str(tmp_path), K) == []
    assert plots.make_plots({}, str(tmp_path), K) == []


def test_derived_reward_and_tokens_match_the_trajectories(tables):
    view = plots.updates_view({"updates": {k: tables["updates"][k] for k in ("update", "start", "end")},
                               "trajectories": tables["trajectories"]}, 0.0)
    traj = tables["trajectories"]
    sel = traj["consumed_by"] == 3
    assert view["reward_mean"][3] == pytest.approx(traj["reward"][sel].mean())
    assert view["tokens"][3] == (traj["prompt_len"][sel] + traj["response_len"][sel]).sum()


def test_staleness_violation_and_many_versions_render(tmp_path):
    assert_real_png(plots.plot_staleness(np.array([0, 1, 1, 2, 3, 3]), 1, str(tmp_path / "s.png")), 5_000)
    rng = np.random.default_rng(0)
    n = 120
    start = np.sort(rng.uniform(0, 60, n))
    spans = {"instance": np.array([i % 3 for i in range(n)]), "version": (start // 2).astype(int),
             "group_id": np.arange(n), "start": start, "end": start + rng.exponential(3, n)}
    pubs = [(v, 2.0 * v) for v in range(1, 31)]
    assert_real_png(plots.plot_timeline(spans, pubs, str(tmp_path / "t.png")))  # 30 versions: colour bar


def test_pack_lanes_never_overlaps_within_a_lane():
    rng = np.random.default_rng(1)
    start = rng.uniform(0, 10, 50)
    end = start + rng.exponential(2, 50)
    lane, lanes = plots.pack_lanes(start, end)
    for k in range(lanes):
        order = np.argsort(start[lane == k])
        s, e = start[lane == k][order], end[lane == k][order]
        assert (s[1:] >= e[:-1]).all()
    assert lanes == max(((start <= t) & (end > t)).sum() for t in start)  # greedy by start is optimal


def test_versions_in_flight_counts_distinct_versions():
    version = np.array([0, 0, 1, 2])
    start = np.array([0.0, 1.0, 2.0, 5.0])
    end = np.array([4.0, 3.0, 6.0, 7.0])
    times = np.array([0.5, 2.5, 4.5, 5.5, 8.0])
    assert plots.versions_in_flight(version, start, end, times).tolist() == [1, 2, 1, 2, 0]


def test_covered_share_and_steady_throughput():
    intervals = np.array([[0.0, 2.0], [1.0, 3.0], [5.0, 6.0]])
    assert plots._covered_share(intervals, 0.0, 10.0) == pytest.approx(0.4)
    assert plots._covered_share(intervals, 2.5, 5.5) == pytest.approx(1 / 3)
    end = np.array([1.0, 2.0, 4.0, 6.0])
    tokens = np.array([100.0, 100.0, 300.0, 500.0])
    assert plots.steady_throughput(end, tokens) == pytest.approx(800.0 / 4.0)
    assert np.isnan(plots.steady_throughput(end[:3], tokens[:3]))


def test_store_tables_map_onto_the_plots(tmp_path):
    """The column names make_plots reads are the ones the real trajectory store writes (no rendering: fast)."""
    from storage.synthetic import simulate_run
    from storage.trajectory_store import TrajectoryStore

    with TrajectoryStore.create(str(tmp_path / "t.zarr"), {"group_size": 4, "max_staleness": K}) as store:
        run = simulate_run(store, updates=6, group_size=4, max_staleness=K)
    reader = TrajectoryStore.open(str(tmp_path / "t.zarr"))
    tables = {name: reader.read_table(name) for name in ("trajectories", "updates", "dispatch")}
    t0 = plots._time_origin(tables)
    view = plots.updates_view(tables, t0)
    np.testing.assert_array_equal(view["reward_mean"], tables["updates"]["metrics/reward_mean"])
    assert np.isfinite(view["tokens"]).all() and (view["tokens"] > 0).all()
    assert np.isfinite(view["trainer_bubble"]).all()
    spans = plots.group_spans(tables["trajectories"], t0)
    assert len(spans["group_id"]) == len(run.consumed) and spans["consumed"].all()
    assert [v for v, _ in plots.publish_times(tables["updates"], t0)] == list(range(1, 7))
