"""Peer-to-peer weights: a version is read from the store once and copied between workers by Dask.

On a real LocalCluster (worker processes): an instance copies a version from the worker that read it; once that worker
is gone, the next instance copies it from the first instance (a peer); once every holder is gone, the store is read
again (the fallback). End to end, every (instance, version) pair that generated a group received its copy, and the
update metrics record the copies.
"""
from __future__ import annotations

import contextlib
import os

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from dora_tasks import steps
from pipelines.inputs import RunInputs
from pipelines.streaming import run_pipeline
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightFiles, WeightStore, WeightStoreError
from waiting import wait_until


def received(shipped):
    return steps._received(shipped)


def kill(client: Client, *addresses: str) -> None:
    """Kill the worker processes (their nannies start new ones, which hold nothing) and wait until they are gone."""
    with contextlib.suppress(Exception):  # the call dies with them
        client.run(os._exit, 1, workers=list(addresses))
    wait_until(lambda: not set(addresses) & set(client.scheduler_info()["workers"]), 30, "the workers left")


@pytest.fixture
def store(tmp_path):
    weights = WeightStore(str(tmp_path / "weights"))

    def write(folder):
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(np.random.default_rng(0).bytes(200_000))

    weights.publish(1, write)
    return weights


def test_a_version_is_copied_from_a_peer_and_read_again_only_when_every_holder_is_gone(store):
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):  # replicas stay put
        with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            reader, a, b = sorted(client.scheduler_info()["workers"])
            shipped = client.submit(steps.read_weights, 1, store.path_for(1), key=("weights", 1), workers=[reader],
                                    allow_other_workers=True,
                                    pure=False)
            first = client.submit(received, shipped, workers=[a], pure=False).result()
            assert (first.source, first.nbytes) == (reader, 200_000) and first.seconds > 0
            kill(client, reader)  # a still holds a copy
            second = client.submit(received, shipped, workers=[b], pure=False).result()
            assert second.source == a
            kill(client, a, b)  # every holder is gone
            client.wait_for_workers(3, timeout=60)
            survivor = sorted(client.scheduler_info()["workers"])[0]
            third = client.submit(received, shipped, workers=[survivor], pure=False).result(timeout=60)
            assert third.nbytes == 200_000  # read from the store again


def test_reading_a_version_the_store_no_longer_holds_fails_with_its_name(tmp_path):
    store = WeightStore(str(tmp_path / "weights"))
    store.publish(0, lambda folder: open(os.path.join(folder, "config.json"), "w").close())
    assert WeightFiles.read(0, store.path_for(0)).files == {"config.json": b""}
    store.retain(set())
    with pytest.raises(WeightStoreError, match="version 0 is not in the weight store"):
        WeightFiles.read(0, store.path_for(0))


@pytest.mark.slow
def test_every_instance_receives_each_version_it_generates_on_from_the_cluster(small_config, shared_cluster):
    cfg = small_config("dora.max_staleness=1", "dora.num_updates=4")
    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    assert summary.audit_ok, summary.audit_text
    store = TrajectoryStore.open(summary.store)
    t, updates = store.read_table("trajectories"), store.read_table("updates")
    pairs = {(i, v) for i, v in zip(t["instance"].tolist(), t["version"].tolist()) if v >= 1}
    copies = updates["metrics/weights_peer_copies"]
    assert pairs and copies.sum() >= len(pairs)  # version 0 came from the store at warm-up
    copied = copies > 0
    per_copy = updates["metrics/weights_peer_bytes"][copied] / copies[copied]
    assert np.allclose(per_copy, per_copy[0]) and per_copy[0] > 100_000  # one whole model folder a copy
