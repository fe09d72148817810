"""Faults a shared cluster sees: a trainer lost at any moment, rewards that always fail, a broken reward path, a run
stopped before its first checkpoint, evaluations that fail or still need their weights. Real clusters and processes."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dora_tasks.workloads.rewards import RewardError, check_reward_fn
from pipelines.driver import Driver
from pipelines.events import EvaluationTask, TrainerRestored
from pipelines.gate import VersionGate
from pipelines.inputs import RunInputs
from pipelines.orchestrator import Orchestrator
from pipelines.reward_checks import RewardFailureError
from pipelines.run import open_run
from pipelines.streaming import resume_pipeline, run_pipeline, stream
from storage.audit import audit_store
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def mlflow_steps(summary_or_run_dir, tracking_uri: str, metric: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    run_dir = summary_or_run_dir
    run_id = open(os.path.join(run_dir, "mlflow_run_id.txt")).read().strip()
    return sorted(m.step for m in MlflowClient(tracking_uri).get_metric_history(run_id, metric))


def kill_trainer(d) -> None:
    pid = d.client.run(os.getpid, workers=[d.trainer])[d.trainer]
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_trainer_killed_idle_in_an_update_and_at_a_checkpoint_the_run_goes_on(small_config, monkeypatch):
    """SIGKILL of the trainer worker while it trains, while it is due a checkpoint (its first) and while it idles:
    each time a restarted trainer goes on from the newest version, no version is lost or published twice."""
    N = 9
    cfg = small_config("dora.max_staleness=1", f"dora.num_updates={N}", "storage.checkpoint_interval=3")
    killed: list[str] = []
    checkpoint = Driver.checkpoint

    def kill_before_the_first_checkpoint(driver, update):
        if "checkpoint" not in killed:
            killed.append("checkpoint")
            kill_trainer(driver)
        checkpoint(driver, update)

    def kill_in_an_update_then_idle(d):
        if "update" not in killed and d.gate.next_update >= 4 and d.updates:
            killed.append("update")
            kill_trainer(d)
        elif "idle" not in killed and "update" in killed and d.gate.next_update >= 6 and not d.updates:
            killed.append("idle")
            kill_trainer(d)

    monkeypatch.setattr(Driver, "checkpoint", kill_before_the_first_checkpoint)
    restored: list[TrainerRestored] = []
    with open_run(cfg) as run:
        run.driver.subscribe(lambda e: restored.append(e) if isinstance(e, TrainerRestored) else None)
        stream(run.driver, on_turn=kill_in_an_update_then_idle)
        summary = run.finish()
    assert killed == ["checkpoint", "update", "idle"]
    assert len(restored) == 3 and restored[0].optimizer_from == ""  # no checkpoint before the first one
    assert all(re.search(r"ckpt-00000[25]/trainer$", r.optimizer_from) for r in restored[1:])  # the latest one
    assert summary.audit_ok, summary.audit_text
    updates = TrajectoryStore.open(summary.store).read_table("updates")
    assert updates["update"].tolist() == list(range(N))
    assert updates["published_version"].tolist() == list(range(1, N + 1))
    assert updates["metrics/trainer_restarts"][-1] == 3
    assert run.checkpoints.updates() == [2, 5]  # the checkpoint the kill interrupted was taken once restored
    assert mlflow_steps(cfg.storage.run_dir, summary.tracking_uri, "trainer_restarts") == list(range(N))


@pytest.mark.slow
@pytest.mark.parametrize("reward_fn", [  # a non-number is recorded like an exception (test_reward_row)
    "faulty_rewards.always_raises", pytest.param("faulty_rewards.returns_text", marks=pytest.mark.long)])
def test_a_reward_that_always_fails_stops_the_run_with_its_error(small_config, shared_cluster, reward_fn):
    cfg = small_config(f"task.reward_fn={reward_fn}", "dora.num_updates=6", "task.reward_failure_stop_updates=2")
    with pytest.raises(RewardFailureError) as err:
        run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    message = str(err.value)
    assert "every reward of the last 2 updates failed" in message and reward_fn in message
    assert ("KeyError" if "raises" in reward_fn else "non-number") in message
    store = cfg.storage.resolved("trajectory_store")
    assert TrajectoryStore.open(store).num_rows("updates") == 2  # both updates kept, then the stop
    report = audit_store(store)
    assert sum(report.reward_errors.values()) == 2 * cfg.dora.train_batch_size * cfg.rollout.group_size
    assert "reward failures" in report.to_text()


def test_a_reward_path_that_does_not_resolve_fails_at_once_and_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    started = time.time()
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", f"storage.run_dir={run_dir}",
                          "task.reward_fn=faulty_rewards.no_such_function"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": TESTS})
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("dora: error: ")
    assert "no_such_function" in out.stderr and "Traceback" not in out.stderr
    assert time.time() - started < 30  # before any cluster, warm start or MLflow run
    assert not run_dir.exists()


def test_a_reward_that_cannot_take_three_arguments_is_refused_before_work():
    with pytest.raises(RewardError, match="takes_one_argument"):
        check_reward_fn("faulty_rewards.takes_one_argument")


def test_resume_of_a_run_folder_that_is_not_a_run_is_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("dora: {num_updates: 2\n")  # damaged
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "resume", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.startswith("dora: error: ")


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_resumes_from_the_start(small_config, shared_cluster):
    cfg = small_config("dora.num_updates=2", "storage.checkpoint_interval=0", "task.eval_interval=1")
    on_shared = RunInputs(client=shared_cluster(cfg))
    first = run_pipeline(cfg, on_shared)
    summary = resume_pipeline(cfg.storage.run_dir, ["dora.num_updates=3", "tracking.live_view=false"], on_shared)
    assert summary.audit_ok, summary.audit_text
    updates = TrajectoryStore.open(summary.store).read_table("updates")
    assert updates["update"].tolist() == [0, 1, 2]  # started again: the first attempt's two updates are gone
    assert mlflow_steps(cfg.storage.run_dir, summary.tracking_uri, "reward_mean") == [0, 1, 2]
    assert mlflow_steps(cfg.storage.run_dir, summary.tracking_uri, "accuracy") == [0, 1, 2, 3]  # version 0 too
    assert summary.mlflow_run_id != first.mlflow_run_id


# ---- no cluster: the driver's bookkeeping -----------------------------------------------------------------------
class FailedFuture:
    status = "error"
    key = ("evaluate", 2)

    def exception(self):
        return FileNotFoundError("model.safetensors")

    def add_done_callback(self, fn):
        pass


def bare_driver(small_config, tmp_path) -> Driver:
    cfg = small_config()
    weights = WeightStore(str(tmp_path / "weights"))
    for v in range(4):
        weights.publish(v, lambda folder: open(os.path.join(folder, "w"), "w").close())
    gate = VersionGate(cfg.dora.max_staleness, cfg.dora.train_batch_size)
    gate.newest = 3
    return Driver(cfg, None, gate, Orchestrator(8, 64, newest=3), None, weights, "", [], [])


def test_a_version_whose_evaluation_is_queued_is_kept_in_the_weight_store(small_config, tmp_path):
    d = bare_driver(small_config, tmp_path)
    d.track(FailedFuture(), EvaluationTask(version=1, attempt=0))
    d.retain_weights()
    assert d.weights.versions() == [1, 3]
    d.tracked.clear()
    d.retain_weights()
    assert d.weights.versions() == [3]


def test_a_failed_evaluation_is_recorded_and_never_stops_training(small_config, tmp_path):
    d = bare_driver(small_config, tmp_path)
    future = d.track(FailedFuture(), EvaluationTask(version=2, attempt=1))  # its last attempt
    d.on_done(future)
    assert d.counters["eval_failures"] == 1 and not d.evaluations() and 2 not in d.accuracy


def test_a_trainer_loss_names_the_schedulers_reason_for_it():
    from distributed.client import FutureCancelledError

    from dora_tasks.plugins import TrainerLost
    from pipelines.trainer_recovery import loss_reason, removals

    assert loss_reason(FutureCancelledError(("update", 3), reason="already forgotten")) \
        == "FutureCancelledError (already forgotten)"
    assert loss_reason(TrainerLost("gone")) == "TrainerLost"

    class Scheduler:
        def get_events(self, topic):
            assert topic == "tcp://trainer:1"
            return ((1.0, {"action": "add-worker"}),
                    (2.0, {"action": "remove-worker", "stimulus_id": "heartbeat-missing-1", "expected": False}))

    assert removals(Scheduler(), "tcp://trainer:1") == "scheduler removed it (heartbeat-missing-1, expected=False)"
    assert removals(Scheduler(), None) == ""
