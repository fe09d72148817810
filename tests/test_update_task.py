"""The update task on a real trainer worker: it trains, publishes the next version in the same task, and runs in
version order even when a later batch reaches the trainer first (update lookahead)."""
from __future__ import annotations

import shutil

from distributed import Client, LocalCluster

from dora_tasks import steps
from dora_tasks.core.config import TrainConfig
from dora_tasks.plugins import TrainerPlugin
from storage.weight_store import WeightStore
from tests.test_trainers import build_tiny_model, make_batch
from tests.waiting import wait_until

TRAINER = {"TRAINER": 1}


def sent_back(dask_scheduler, key) -> bool:
    """Whether the worker has handed task `key` back to the scheduler (`Reschedule`) at least once."""
    return any(str(stimulus).startswith("reschedule-") for *_, stimulus, _ in dask_scheduler.story(key))


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
        # it reaches the trainer alone: the engine holds version 0, so the update goes back to the scheduler
        wait_until(lambda: client.run_on_scheduler(sent_back, key=("update", 1)), 60,
                   "the early update was sent back to the scheduler")
        assert not early.done()
        late = client.submit(steps.update, first, store.root, key=("update", 0), resources=TRAINER, pure=False)
        one, two = late.result(timeout=60), early.result(timeout=60)
    assert (one.published.version, two.published.version) == (1, 2)
    assert one.end_time <= two.start_time  # version 1 was written before update 1 changed the weights
    assert store.versions() == [0, 1, 2]
    assert one.metrics["loss"] == one.metrics["loss"] and two.metrics["tokens"] > 0  # finite, trained
