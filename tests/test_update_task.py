"""The update task on a real trainer worker: it trains, publishes the next version in the same task, and runs in
version order even when a later batch reaches the trainer first (update lookahead)."""
from __future__ import annotations

import shutil
import time

from distributed import Client, LocalCluster

from dora_tasks import steps
from dora_tasks.core.config import TrainConfig
from dora_tasks.plugins import TrainerPlugin
from storage.weight_store import WeightStore
from tests.test_trainers import build_tiny_model, make_batch

TRAINER = {"TRAINER": 1}


def test_an_update_that_reaches_the_trainer_early_waits_for_the_one_before(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    store = WeightStore(str(tmp_path / "weights"))
    store.publish(0, lambda folder: shutil.copytree(model, folder, dirs_exist_ok=True))
    first, second = make_batch(model, seed=1, update=0), make_batch(model, seed=2, update=1)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={"GPU": 1, "TRAINER": 1},
                      dashboard_address=None) as cluster, Client(cluster) as client:
        client.register_plugin(TrainerPlugin(store.root, TrainConfig()))
        client.submit(steps.warm_up_trainer, 0, resources=TRAINER, pure=False).result(timeout=60)
        early = client.submit(steps.update, second, store.root, key=("update", 1), resources=TRAINER, pure=False)
        time.sleep(1.0)  # it reaches the trainer alone: version 1 does not exist yet, it goes back to the scheduler
        assert not early.done()
        late = client.submit(steps.update, first, store.root, key=("update", 0), resources=TRAINER, pure=False)
        one, two = late.result(timeout=60), early.result(timeout=60)
    assert (one.published.version, two.published.version) == (1, 2)
    assert one.end_time <= two.start_time  # version 1 was written before update 1 changed the weights
    assert store.versions() == [0, 1, 2]
    assert one.metrics["loss"] == one.metrics["loss"] and two.metrics["tokens"] > 0  # finite, trained
