"""Bad input fails fast with an error that names the problem, before any work starts or anything is overwritten."""
from __future__ import annotations

import json
import os
import time

import pytest

from pipelines.cluster import ClusterError
from dora_tasks.core.config import ConfigError, load_config
from pipelines.run import RunFolderError
from pipelines.streaming import run_pipeline
from dora_tasks.workloads.datasets import DatasetError


@pytest.mark.parametrize("override, named", [
    ("dora.bogus_key=1", "dora.bogus_key"),
    ("dora.max_staleness=-1", "dora.max_staleness"),
    ("dora.train_batch_size=32", "dora.rollout_batch_size"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("train.zero_stage=5", "train.zero_stage"),
    ("model.path=/nonexistent/model", "model.path"),
    ("rollout.chunk_tokens=-4", "rollout.chunk_tokens"),
    ("rollout.partial_rollout=true rollout.chunk_tokens=0", "rollout.chunk_tokens"),
])
def test_config_errors_name_the_key(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split())
    assert named in str(err.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_dataset_row_without_its_field_stops_the_run_before_work(small_config, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "count 3:", "answer": "3 2 1"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    cfg = small_config("task.name=dataset", f"task.dataset={data}")
    with pytest.raises(DatasetError) as err:
        run_pipeline(cfg)
    assert "answer" in str(err.value) and "2" in str(err.value) and str(data) in str(err.value)
    assert not os.path.exists(cfg.storage.run_dir)


def test_unreachable_scheduler_is_a_clear_error_before_work(small_config):
    cfg = small_config("cluster.scheduler_address=tcp://127.0.0.1:9", "cluster.connect_timeout_s=2")
    start = time.time()
    with pytest.raises(ClusterError) as err:
        run_pipeline(cfg)
    assert "tcp://127.0.0.1:9" in str(err.value) and "cluster.scheduler_address" in str(err.value)
    assert time.time() - start < 30
    assert not os.path.exists(cfg.storage.run_dir)


def test_a_run_folder_that_holds_a_run_is_never_overwritten(small_config):
    cfg = small_config()
    store = cfg.storage.resolved("trajectory_store")
    os.makedirs(store)
    marker = os.path.join(store, "keep.txt")
    with open(marker, "w") as f:
        f.write("earlier results")
    with pytest.raises(RunFolderError, match="already holds a run"):
        run_pipeline(cfg)
    assert open(marker).read() == "earlier results"


def test_a_worker_paused_by_its_memory_limit_stops_the_run_with_a_clear_error(small_config):
    """Dask pauses a worker above `distributed.worker.memory.pause` of its memory limit and starts no task there: the
    run says so and stops, naming the worker and the setting, instead of waiting forever (here every worker pauses:
    the fraction is set below what a worker process uses)."""
    import dask

    cfg = small_config("cluster.paused_timeout_s=2")
    start = time.time()
    memory = {"distributed.worker.memory.pause": 0.01, "distributed.worker.memory.terminate": False,
              "distributed.worker.memory.target": False, "distributed.worker.memory.spill": False}
    with dask.config.set(memory), pytest.raises(ClusterError) as err:
        run_pipeline(cfg)
    message = str(err.value)
    assert "paused by Dask's memory monitor" in message and "cluster.worker_memory" in message
    assert "GiB limit" in message and "tcp://" in message
    assert time.time() - start < 120


def test_paused_workers_warn_at_once_and_fail_only_after_the_timeout():
    from pipelines.cluster import PausedWorkers, Workers

    def workers(paused):
        return Workers({"tcp://r": 4}, ["tcp://t"], [], paused)

    watch = PausedWorkers()
    watch.check(workers({"tcp://r": "rollout instance"}), 60.0, now=100.0)  # first seen: a warning only
    watch.check(workers({"tcp://r": "rollout instance"}), 60.0, now=150.0)
    watch.check(workers({}), 60.0, now=155.0)  # resumed: the clock starts again
    watch.check(workers({"tcp://r": "rollout instance"}), 60.0, now=156.0)
    watch.check(workers({"tcp://r": "rollout instance"}), 60.0, now=200.0)
    with pytest.raises(ClusterError, match=r"tcp://r \(rollout instance\) has been paused .* for 60 s"):
        watch.check(workers({"tcp://r": "rollout instance"}), 60.0, now=216.0)
