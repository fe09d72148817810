"""Trajectory store, weight store and checkpoint store: round trips, live readers, errors, atomicity."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.checkpoint import CheckpointError, CheckpointStore
from storage.schema import (COLUMNS, RAGGED, SCHEMA_VERSION, ChunkSizes, StoreCorruptError, StoreExistsError,
                            StoreLockedError, StoreNotFoundError, StoreReadOnlyError, StoreSchemaError)
from storage.synthetic import make_group
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore, WeightStoreError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
META = {"group_size": 4, "max_staleness": 1}


def snapshot(path) -> dict[str, str]:
    """Every file under `path` with the hash of its bytes."""
    out = {}
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def groups_for(rng, first_id, n, version, **kw):
    return [make_group(first_id + i, version, rng, group_size=4, **kw) for i in range(n)]


def write_sample(path, rng, chunks=ChunkSizes()):
    """Three batches (two of them pending at once before a flush), with strings and an empty response."""
    batches = [groups_for(rng, 0, 3, 0, instance="tcp://a:1"),
               groups_for(rng, 3, 2, 1, instance="tcp://b:2", filtered="zero_std"),
               groups_for(rng, 5, 2, 1, instance="tcp://a:1", response_lens=[0, 5, 1, 70])]
    batches[0][1].trajectories[2].reward_error = "ValueError: could not parse\nTraceback ..."
    store = TrajectoryStore.create(path, META, chunks=chunks)
    for g in (g for b in batches for g in b):
        store.append_dispatch(g.group_id, g.prompt.prompt_id, g.version, g.attempt, 1.0 + g.group_id)
    store.append_consumed(batches[0], update=0, time=10.0)
    store.append_consumed(batches[1], update=1, time=11.0)
    store.flush()
    store.append_consumed(batches[2], update=2, time=12.0)
    store.append_update(0, 9.0, 10.0, 1, 0.5, {"loss": 1.0})
    store.append_update(1, 10.0, 11.0, 2, 0.25, {"loss": 0.5, "kl": 0.1})
    return store, batches


@pytest.fixture(scope="module")
def closed_sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("sample") / "s.zarr"
    write_sample(path, np.random.default_rng(2))[0].close()
    return path


@pytest.fixture
def sample_copy(closed_sample, tmp_path):
    shutil.copytree(closed_sample, tmp_path / "s.zarr")
    return tmp_path / "s.zarr"


# -------------------------------------------------------------------- trajectory store
def test_round_trip_of_groups_with_ragged_data(tmp_path):
    rng = np.random.default_rng(0)
    store, batches = write_sample(tmp_path / "s.zarr", rng)
    store.close()
    reader = TrajectoryStore.open(tmp_path / "s.zarr")
    table = reader.read_table("trajectories")
    expected = [(g, t, u) for u, b in enumerate(batches) for g in b for t in g.trajectories]
    assert reader.num_rows("trajectories") == len(expected) == 28
    tokens = reader.read_ragged("tokens", range(len(expected)))
    versions = reader.read_ragged("token_versions", range(len(expected)))
    logprobs = reader.read_ragged("behaviour_logprobs", list(reversed(range(len(expected)))))[::-1]
    for row, (g, t, u) in enumerate(expected):
        assert table["group_id"][row] == g.group_id and table["sample_idx"][row] == t.sample_idx
        assert table["version"][row] == g.version and table["consumed_by"][row] == u
        assert table["instance"][row] == g.instance and table["filtered"][row] == g.filtered
        assert table["prompt_len"][row] == len(t.prompt_ids) and table["response_len"][row] == len(t.response_ids)
        assert table["reward"][row] == np.float32(t.reward) and table["advantage"][row] == np.float32(t.advantage)
        assert table["finished"][row] == t.finished
        np.testing.assert_array_equal(tokens[row], np.concatenate([t.prompt_ids, t.response_ids]))
        np.testing.assert_array_equal(versions[row], t.versions)
        np.testing.assert_array_equal(logprobs[row], t.behaviour_logprobs)
    assert table["reward_error"][1 * 4 + 2] == "ValueError: could not parse"
    assert set(table["reward_error"]) == {"", "ValueError: could not parse"}
    assert reader.read_table("dispatch")["group_id"].tolist() == list(range(7))
    updates = reader.read_table("updates")
    assert updates["published_version"].tolist() == [1, 2]
    np.testing.assert_array_equal(updates["metrics/kl"], [np.nan, 0.1])  # a metric column created on first use
    assert reader.meta == META and reader.vocab("instance") == ["", "tcp://a:1", "tcp://b:2"]


@settings(max_examples=6, deadline=None)
@given(ops=st.lists(st.one_of(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.sampled_from(
    ["flush", "checkpoint", "truncate"])), max_size=8), seed=st.integers(0, 2**16))
def test_model_based_appends_flushes_and_truncations(ops, seed):
    """Random interleavings of batches (response lengths, 0 allowed), flushes, checkpoints and truncate_to, on
    small chunks, against a plain list model."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        store = TrajectoryStore.create(f"{tmp}/s.zarr", META, chunks=ChunkSizes(trajectories=4, ragged=16))
        model, saved, next_id = [], ([], store.row_counts()), 0
        for op in ops:
            if op == "flush":
                store.flush()
            elif op == "checkpoint":
                saved = (list(model), store.row_counts())
            elif op == "truncate":
                store.truncate_to(saved[1])
                model = list(saved[0])
            else:
                group = make_group(next_id, 0, rng, group_size=len(op), response_lens=op, prompt_len=int(op[0]))
                store.append_consumed([group], 0, 0.0)
                model += [np.concatenate([t.prompt_ids, t.response_ids]) for t in group.trajectories]
                next_id += 1
        store.close()
        reader = TrajectoryStore.open(f"{tmp}/s.zarr")
        got = reader.read_ragged("tokens", range(reader.num_rows("trajectories")))
        assert len(got) == len(model)
        for a, b in zip(got, model):
            np.testing.assert_array_equal(a, b)


def test_appends_flush_at_chunk_size_and_close(tmp_path):
    path = tmp_path / "s.zarr"
    store = TrajectoryStore.create(path, META, chunks=ChunkSizes(dispatch=4))
    for gid in range(6):
        store.append_dispatch(gid, gid, 0, 0, float(gid))
    assert TrajectoryStore.open(path).num_rows("dispatch") == 4  # the fifth row waits for the next chunk or flush
    store.close()
    assert TrajectoryStore.open(path).num_rows("dispatch") == 6


def test_reader_in_another_process_sees_flushed_rows_while_writer_is_open(tmp_path):
    path = tmp_path / "s.zarr"
    store, batches = write_sample(path, np.random.default_rng(1))  # first two batches flushed, third pending
    script = textwrap.dedent(f"""
        from storage.trajectory_store import TrajectoryStore
        s = TrajectoryStore.open({str(path)!r})
        n = s.num_rows("trajectories")
        v = s.read_ragged("token_versions", range(n))
        print(n, s.num_rows("dispatch"), s.num_rows("updates"), sorted({{int(x) for r in v for x in r}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=3) == ["20", "7", "0", "[0, 1]\n"]
    store.close()


def test_open_refuses_another_schema_version_and_modifies_nothing(sample_copy):
    path = sample_copy
    zarr.open_group(path, mode="r+").attrs["schema_version"] = SCHEMA_VERSION + 98
    before = snapshot(path)
    both = f"schema_version {SCHEMA_VERSION + 98}.*schema_version {SCHEMA_VERSION}"
    with pytest.raises(StoreSchemaError, match=both):
        TrajectoryStore.open(path)
    with pytest.raises(StoreSchemaError):
        TrajectoryStore.open(path, mode="a")
    assert snapshot(path) == before


@pytest.mark.parametrize("damage, message", [
    ("delete_array", "missing arrays: trajectories/reward"),
    ("shorten_array", "trajectories/advantage has 4 rows, fewer than the 28 committed"),
    ("shorten_ragged", "ragged/tokens has 10 rows"),
    ("delete_root", "no root zarr.json"),
])
def test_truncated_store_raises_corrupt_error_and_modifies_nothing(sample_copy, damage, message):
    path = sample_copy
    root = zarr.open_group(path, mode="r+")
    if damage == "delete_array":
        shutil.rmtree(path / "trajectories" / "reward")
    elif damage == "shorten_array":
        root["trajectories/advantage"].resize((4,))
    elif damage == "shorten_ragged":
        root["ragged/tokens"].resize((10,))
    else:
        os.remove(path / "zarr.json")
    before = snapshot(path)
    for mode in ("r", "a"):
        with pytest.raises(StoreCorruptError, match=message):
            TrajectoryStore.open(path, mode=mode)
    assert snapshot(path) == before


def test_uncommitted_tail_is_ignored_by_readers_and_trimmed_by_the_next_writer(sample_copy):
    path = sample_copy
    n = TrajectoryStore.open(path).num_rows("trajectories")
    zarr.open_group(path, mode="r+")["trajectories/reward"].resize((n + 5,))  # a writer died mid-flush
    assert TrajectoryStore.open(path).read_table("trajectories")["reward"].shape == (n,)
    TrajectoryStore.open(path, mode="a").close()
    assert zarr.open_group(path, mode="r")["trajectories/reward"].shape == (n,)


def test_truncate_to_drops_rows_after_a_checkpoint_and_appends_cleanly(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "s.zarr"
    store = TrajectoryStore.create(path, META, chunks=ChunkSizes(trajectories=16, ragged=64))
    first = groups_for(rng, 0, 3, 0)
    store.append_consumed(first, 0, 1.0)
    store.append_update(0, 0.0, 1.0, 1, 0.1, {"loss": 1.0})
    counts = store.row_counts()
    store.append_consumed(groups_for(rng, 3, 2, 1), 1, 2.0)
    store.append_dispatch(9, 9, 1, 0, 2.0)
    store.append_update(1, 1.0, 2.0, 2, 0.1, {"loss": 2.0, "new": 3.0})
    store.close()
    store = TrajectoryStore.open(path, mode="a")
    dropped = store.truncate_to(counts)
    assert dropped.counts == {"dispatch": 1, "trajectories": 8, "updates": 1, "migrations": 0}
    assert dropped.tables["trajectories"]["group_id"].tolist() == [3] * 4 + [4] * 4
    again = groups_for(rng, 3, 2, 1, response_lens=[1, 1, 1, 1])  # shorter: stale tokens would show
    store.append_consumed(again, 1, 3.0)
    store.close()
    reader = TrajectoryStore.open(path)
    assert reader.num_rows("trajectories") == 20
    rows = range(12, 20)
    expected = [np.concatenate([t.prompt_ids, t.response_ids]) for g in again for t in g.trajectories]
    for got, want in zip(reader.read_ragged("tokens", rows), expected):
        np.testing.assert_array_equal(got, want)
    assert zarr.open_group(path, mode="r")["ragged/tokens"].shape[0] == reader.read_table(
        "trajectories")["tokens_start"][-1] + 16 + 1


def test_create_refuses_existing_store_and_writers_are_exclusive(tmp_path):
    path = tmp_path / "s.zarr"
    store = TrajectoryStore.create(path, META)
    with pytest.raises(StoreLockedError):
        TrajectoryStore.open(path, mode="a")
    with pytest.raises(StoreLockedError):
        TrajectoryStore.create(path, META, overwrite=True)
    store.close()
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        TrajectoryStore.create(path, META)
    TrajectoryStore.create(path, {"group_size": 2}, overwrite=True).close()
    assert TrajectoryStore.open(path).meta == {"group_size": 2}
    with pytest.raises(StoreNotFoundError):
        TrajectoryStore.open(tmp_path / "nowhere.zarr")


def test_read_only_store_refuses_writes(tmp_path):
    TrajectoryStore.create(tmp_path / "s.zarr", META).close()
    reader = TrajectoryStore.open(tmp_path / "s.zarr")
    with pytest.raises(StoreReadOnlyError):
        reader.append_dispatch(0, 0, 0, 0, 0.0)


def test_malformed_trajectory_is_refused(tmp_path):
    store = TrajectoryStore.create(tmp_path / "s.zarr", META)
    group = make_group(0, 0, np.random.default_rng(0), group_size=2)
    group.trajectories[1].versions = group.trajectories[1].versions[:-1]
    with pytest.raises(ValueError, match="versions"):
        store.append_consumed([group], 0, 0.0)
    store.close()


def test_fsspec_url_round_trip():
    url = "memory://test-storage/s.zarr"
    store = TrajectoryStore.create(url, META, overwrite=True)
    store.append_consumed([make_group(0, 0, np.random.default_rng(0))], 0, 1.0)
    store.close()
    reader = TrajectoryStore.open(url)
    assert reader.num_rows("trajectories") == 8
    assert len(reader.read_ragged("tokens", [7])[0]) > 16


def test_schema_page_documents_every_array():
    with open(os.path.join(REPO, "docs", "storage-schema.md")) as f:
        page = f.read()
    names = [c.name for cols in COLUMNS.values() for c in cols] + list(RAGGED)
    assert [n for n in names if f"`{n}`" not in page] == []


# -------------------------------------------------------------------- weight store
def write_weights(text):
    def write(folder):
        with open(os.path.join(folder, "model.safetensors"), "w") as f:
            f.write(text)
    return write


def test_weight_store_publishes_atomically_and_retains(tmp_path):
    weights = WeightStore(str(tmp_path / "w"))
    assert weights.latest() is None and weights.versions() == []
    for v in range(4):
        published = weights.publish(v, write_weights(f"v{v}"))
        assert published.path == str(tmp_path / "w" / f"v{v:06d}") and published.seconds >= 0
    assert weights.latest() == 3

    def crash(folder):
        write_weights("half")(folder)
        raise RuntimeError("trainer died")

    with pytest.raises(RuntimeError):
        weights.publish(4, crash)
    assert weights.versions() == [0, 1, 2, 3] and sorted(os.listdir(tmp_path / "w")) == [f"v{v:06d}" for v in range(4)]
    with pytest.raises(WeightStoreError, match="already published"):
        weights.publish(3, write_weights("again"))
    weights.publish(3, write_weights("again"), overwrite=True)
    with open(os.path.join(weights.path_for(3), "model.safetensors")) as f:
        assert f.read() == "again"
    assert weights.retain({1, 3}) == [0, 2]
    assert weights.versions() == [1, 3]


def test_weight_store_on_an_fsspec_url():
    weights = WeightStore("memory://test-weights/run1")
    weights.retain(set())
    weights.publish(0, write_weights("v0"))
    weights.publish(1, write_weights("v1"))
    assert weights.versions() == [0, 1]
    assert weights.retain({1}) == [0] and weights.latest() == 1


# -------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_incomplete_folders_are_skipped(tmp_path):
    ckpts = CheckpointStore(str(tmp_path / "ckpt"))
    assert ckpts.latest() is None
    state = {"gate": {"newest": 3}, "rows": {"trajectories": np.int64(40)}, "rng": np.arange(3)}
    saved = ckpts.save(3, state, {"trainer": write_weights("w3"), "optimizer": write_weights("o3")})
    assert saved.state == {"gate": {"newest": 3}, "rows": {"trajectories": 40}, "rng": [0, 1, 2]}
    assert os.path.isfile(os.path.join(saved.file("trainer"), "model.safetensors"))
    os.makedirs(tmp_path / "ckpt" / "ckpt-000005" / "trainer")  # a save that never reached COMPLETE
    with open(tmp_path / "ckpt" / "ckpt-000005" / "state.json", "w") as f:
        json.dump({"gate": "half"}, f)
    assert ckpts.latest().update == 3 and ckpts.updates() == [3]
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpts.load(5)


def test_checkpoint_save_failure_leaves_nothing(tmp_path):
    ckpts = CheckpointStore(str(tmp_path / "ckpt"))

    def crash(folder):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        ckpts.save(1, {"a": 1}, {"trainer": crash})
    assert os.listdir(tmp_path / "ckpt") == []
    with pytest.raises(TypeError, match="JSON-able"):
        ckpts.save(1, {"a": object()})


def test_checkpoint_errors_name_the_path_and_prune_keeps_the_newest(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(CheckpointError, match=f"{missing}.*does not exist"):
        CheckpointStore(str(missing)).load_latest()
    ckpts = CheckpointStore(str(tmp_path / "ckpt"))
    os.makedirs(tmp_path / "ckpt" / "ckpt-000001")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*ckpt \(incomplete.*ckpt-000001"):
        ckpts.load_latest()
    for u in (2, 4, 6):
        ckpts.save(u, {"u": u})
    assert ckpts.prune(keep_last=2) == [1, 2]
    assert ckpts.updates() == [4, 6] and ckpts.load_latest().state == {"u": 6}


def test_weight_store_retain_spares_versions_newer_than_asked(tmp_path):
    weights = WeightStore(str(tmp_path / "w"))
    for v in range(5):
        weights.publish(v, write_weights(f"v{v}"))
    assert weights.retain({2}, newer_than=2) == [0, 1]
    assert weights.versions() == [2, 3, 4]
    assert weights.retain({2}) == [3, 4]
