"""The audit: clean on a consistent synthetic run; each planted violation (in a copied store) found with its count."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import zarr

from storage.audit import audit_store, main, max_concurrent_versions
from storage.synthetic import simulate_run
from storage.trajectory_store import TrajectoryStore

G, K, UPDATES = 4, 2, 8


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit") / "clean.zarr"
    with TrajectoryStore.create(path, {"group_size": G, "max_staleness": K}) as store:
        run = simulate_run(store, updates=UPDATES, groups_per_version=4, group_size=G, max_staleness=K, seed=0)
    return path, run


@pytest.fixture
def copy(clean, tmp_path):
    path = tmp_path / "copy.zarr"
    shutil.copytree(clean[0], path)
    return path


def snapshot(path) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(path) for f in files}


def edit_trajectories(path, edit):
    """Rewrite the committed trajectory rows through plain zarr, as an outside tamperer would."""
    root = zarr.open_group(path, mode="r+")
    n = root.attrs["committed"]["trajectories"]
    cols = {name: root[f"trajectories/{name}"][:n] for name in root["trajectories"].array_keys()}
    cols = edit(cols)
    rows = len(cols["group_id"])
    for name, data in cols.items():
        root[f"trajectories/{name}"].resize((rows,))
        root[f"trajectories/{name}"][:] = data
    root.attrs["committed"] = {**root.attrs["committed"], "trajectories": rows}


def rows_of(cols, gid):
    return np.flatnonzero(cols["group_id"] == gid)


def first_group(cols, version):
    return int(cols["group_id"][np.flatnonzero(cols["version"] == version)[0]])


def test_clean_store_audits_clean(clean, capsys):
    path, run = clean
    report = audit_store(path)
    assert report.ok, report.to_text()
    assert report.counts["consumed_groups"] == len(run.consumed)
    assert report.counts["trajectories"] == G * len(run.consumed)
    assert report.counts["dispatch_rows"] == run.dispatch_rows and report.counts["redispatches"] == 1
    assert report.staleness_histogram == run.staleness_histogram
    assert report.max_staleness_seen == max(run.staleness_histogram)
    assert report.filtered == run.filtered and report.in_flight_groups == run.in_flight
    assert report.reward_errors == {"timeout": 1}
    assert report.versions_live_concurrently == K + 1 and report.max_versions_per_instance == 1
    assert sum(sum(v.values()) for v in report.update_versions.values()) == len(run.consumed)
    before = snapshot(path)
    assert main([str(path)]) == 0
    assert snapshot(path) == before  # the audit only reads
    text = capsys.readouterr().out
    assert "RESULT: OK" in text and "staleness histogram" in text
    assert main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def plant_mixed_version(path):
    root = zarr.open_group(path, mode="r+")
    length = root["trajectories/response_len"][:]
    row = int(np.flatnonzero(length >= 2)[0])
    at = int(root["trajectories/response_start"][row]) + 1
    root["ragged/token_versions"][at] = int(root["trajectories/version"][row]) + 1


def plant_dropped_member(path):
    edit_trajectories(path, lambda c: {k: np.delete(v, 5) for k, v in c.items()})


def plant_duplicate(path):
    edit_trajectories(path, lambda c: {k: np.append(v, v[5:6]) for k, v in c.items()})


def plant_stale(path):
    def edit(cols):
        rows = rows_of(cols, first_group(cols, 0))
        cols["consumed_by"][rows] = K + 1  # a version-0 group consumed by update K + 1
        return cols
    edit_trajectories(path, edit)


def plant_lost(path):
    def edit(cols):
        keep = cols["group_id"] != first_group(cols, 0)
        return {k: v[keep] for k, v in cols.items()}
    edit_trajectories(path, edit)


def plant_undispatched(path):
    def edit(cols):
        cols["group_id"][rows_of(cols, first_group(cols, 0))] = 10**6
        return cols
    edit_trajectories(path, edit)


@pytest.mark.parametrize("plant, expected", [
    (plant_mixed_version, {"mixed_version_trajectories": 1, "token_version_mismatch": 1}),
    (plant_dropped_member, {"missing_trajectories": 1}),
    (plant_duplicate, {"duplicate_trajectories": 1}),
    (plant_stale, {"staleness_violations": G}),
    (plant_lost, {"lost_groups": 1}),
    (plant_undispatched, {"undispatched_groups": 1, "lost_groups": 1}),
], ids=lambda p: getattr(p, "__name__", None))
def test_planted_violation_is_found_with_its_count(copy, plant, expected, capsys):
    plant(copy)
    report = audit_store(copy)
    assert {v.name: v.count for v in report.violations} == expected, report.to_text()
    assert not report.ok
    assert main([str(copy)]) == 1
    out = capsys.readouterr().out
    assert all(name in out for name in expected)


def test_k0_audit_of_a_multi_version_store_flags_stale_trajectories_and_mixed_batches(clean):
    path, run = clean
    report = audit_store(path, max_staleness=0)
    stale = sum(n for s, n in run.staleness_histogram.items() if s > 0)
    assert report.count("staleness_violations") == stale
    assert report.count("mixed_version_batches") == sum(len(v) > 1 for v in report.update_versions.values()) > 0


def test_synchronous_run_is_clean_with_one_version_live(tmp_path):
    with TrajectoryStore.create(tmp_path / "k0.zarr", {"group_size": 2, "max_staleness": 0}) as store:
        simulate_run(store, updates=4, groups_per_version=3, group_size=2, max_staleness=0)
    report = audit_store(tmp_path / "k0.zarr")
    assert report.ok, report.to_text()
    assert report.staleness_histogram == {0: 2 * 3 * 4} and report.versions_live_concurrently == 1


def test_max_concurrent_versions():
    assert max_concurrent_versions([]) == 0
    assert max_concurrent_versions([(0, 1, 0), (1, 2, 1)]) == 1  # touching spans do not overlap
    assert max_concurrent_versions([(0, 3, 0), (1, 2, 1), (1.5, 4, 2), (2.5, 5, 0)]) == 3
    assert max_concurrent_versions([(0, 5, 0), (1, 2, 0)]) == 1


def test_unusable_store_exits_2_with_a_one_line_error(tmp_path, clean, capsys):
    assert main([str(tmp_path / "missing.zarr")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("storage.audit: error: no trajectory store at") and err.count("\n") == 1
    bad = tmp_path / "bad.zarr"
    shutil.copytree(clean[0], bad)
    zarr.open_group(bad, mode="r+").attrs["schema_version"] = 7
    assert main([str(bad)]) == 2
    assert "schema_version 7" in capsys.readouterr().err
    shutil.rmtree(bad / "ragged" / "token_versions")
    zarr.open_group(bad, mode="r+").attrs["schema_version"] = 1
    assert main([str(bad)]) == 2
    assert "missing arrays: ragged/token_versions" in capsys.readouterr().err
