"""Seeded chaos: SIGKILL one process of a running job by its PID (a rollout worker, the trainer, the CPU worker or the
driver) at a random moment, `dora resume` where the driver died, and check what must hold whatever was killed: the
store passes the audit, versions are contiguous, every dispatched prompt is trained exactly once, and MLflow holds
each step of each metric once, equal to the store.

The default suite runs one trial (the driver, killed after its fifth update and resumed from its checkpoint);
`pytest -m long` adds the trainer's (the default suite kills the trainer at three chosen moments in test_faults);
`pytest -m chaos` runs DORA_CHAOS_TRIALS (default 6) trials from seed DORA_CHAOS_SEED (default 0) on, whose victim
and moment come from the seed."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
import psutil
import pytest

from conftest import SMALL_RUN
from processes import dora, kill_group, resume_to_end
from storage.audit import audit_store
from storage.trajectory_store import TrajectoryStore

VICTIMS = ("rollout", "trainer", "cpu", "driver")
N, K, TBS, G = 10, 1, 4, 4
RUN_TIMEOUT_S = 900
KILL_WITHIN_S = 0.2  # the moment: this long at most after the chosen update is published
LAST_KILL_UPDATE = N - 4  # the latest chosen update: at least 4 updates remain, so the kill comes before the end


@dataclass
class Trial:
    seed: int
    victim: str
    after_updates: int  # the kill comes once this many updates are published (whatever the machine's speed) ...
    delay_s: float  # ... and this long after
    killed: bool = False
    resumed: bool = False


def wait_for(predicate, proc: subprocess.Popen, log_path, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{open(log_path).read()[-4000:]}"
        assert time.time() < deadline, f"timed out:\n{open(log_path).read()[-4000:]}"
        time.sleep(0.1)


def versions_published(run_dir) -> int:
    """The newest version in the weight store: the run's progress as it happens (the trajectory store buffers)."""
    names = [n for n in os.listdir(run_dir / "weights") if re.fullmatch(r"v\d{6,}", n)] \
        if (run_dir / "weights").is_dir() else []
    return max((int(n[1:]) for n in names), default=0)


def worker_pids(log_path, driver: subprocess.Popen) -> dict[str, int]:
    """The PID of each worker of the embedded cluster by its name, from the scheduler's identity (through the
    dashboard link the run printed) and the ports its child processes listen on."""
    link = re.search(r"Dask dashboard (http://127\.0\.0\.1:\d+)", open(log_path).read()).group(1)
    ports = {int(a.rsplit(":", 1)[1]): str(w["name"]) for a, w in scheduler_identity(link)["workers"].items()}
    pids = {}
    for child in psutil.Process(driver.pid).children(recursive=True):
        for c in child.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports:
                pids[ports[c.laddr.port]] = child.pid
    return pids


def cluster_pids(log_path, driver: subprocess.Popen) -> dict[str, int]:
    """`worker_pids` once all four workers are up (resolved before the kill, when nothing is in a hurry)."""
    found: dict[str, int] = {}

    def all_up() -> bool:
        if "Dask dashboard" not in open(log_path).read():
            return False
        found.update(worker_pids(log_path, driver))
        return len(found) == 4

    wait_for(all_up, driver, log_path)
    return found


def scheduler_identity(link: str, tries: int = 20) -> dict:
    """The scheduler's identity through its dashboard (which answers 500 now and then while workers change)."""
    for _ in range(tries - 1):
        try:
            with urllib.request.urlopen(f"{link}/json/identity.json", timeout=10) as resp:
                return json.load(resp)
        except urllib.error.HTTPError:
            time.sleep(0.2)
    with urllib.request.urlopen(f"{link}/json/identity.json", timeout=10) as resp:
        return json.load(resp)


def run_trial(tmp_path, trial: Trial) -> Trial:
    run_dir = tmp_path / f"run-{trial.seed}"
    store = str(run_dir / "trajectories.zarr")
    overrides = SMALL_RUN + [f"storage.run_dir={run_dir}", f"dora.max_staleness={K}", f"dora.num_updates={N}",
                             f"dora.train_batch_size={TBS}", f"rollout.group_size={G}", "storage.checkpoint_interval=2",
                             "task.eval_interval=4", f"dora.seed={trial.seed}"]
    log_path = tmp_path / f"run-{trial.seed}.log"
    proc = dora(log_path, "run", *overrides)
    try:
        pids = cluster_pids(log_path, proc) | {"driver": proc.pid}
        victim = next(name for name in sorted(pids) if name.startswith(trial.victim))
        wait_for(lambda: versions_published(run_dir) >= trial.after_updates, proc, log_path)
        time.sleep(trial.delay_s)
        if proc.poll() is None:
            os.kill(pids[victim], signal.SIGKILL)
            trial.killed = True
        proc.wait(RUN_TIMEOUT_S)
    finally:
        kill_group(proc)
    if trial.victim != "driver" or not trial.killed:
        assert proc.returncode == 0, open(log_path).read()[-4000:]
    else:
        trial.resumed = True
        resume_to_end(tmp_path / f"resume-{trial.seed}.log", run_dir, timeout_s=RUN_TIMEOUT_S)
    check_whole(run_dir, store)
    return trial


def check_whole(run_dir, store_path: str) -> None:
    report = audit_store(store_path, K)
    assert report.ok, report.to_text()
    store = TrajectoryStore.open(store_path)
    updates = store.read_table("updates")
    assert updates["update"].tolist() == list(range(N))
    assert updates["published_version"].tolist() == list(range(1, N + 1))
    t = store.read_table("trajectories")
    keys = list(zip(t["group_id"].tolist(), t["sample_idx"].tolist()))
    assert len(keys) == len(set(keys)) == N * TBS * G
    assert sorted(set(t["group_id"].tolist())) == list(range(N * TBS))
    check_mlflow(run_dir, updates)


def check_mlflow(run_dir, updates: dict) -> None:
    """Each metric of the MLflow run holds steps 0..N-1 once, with the values the store holds."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    for name in ("reward_mean", "loss", "tokens", "trainer_restarts"):
        history = client.get_metric_history(run_id, name)
        steps = sorted(m.step for m in history)
        assert steps == list(range(N)), (name, steps)
        logged = {m.step: m.value for m in history}
        np.testing.assert_allclose([logged[u] for u in range(N)], updates[f"metrics/{name}"], rtol=1e-6)
    accuracy_steps = sorted(m.step for m in client.get_metric_history(run_id, "accuracy"))
    assert accuracy_steps == [0, 4, 8, 10], accuracy_steps  # version 0, every 4 updates, the last


def trial_of(seed: int, victim: str | None = None) -> Trial:
    rng = random.Random(seed)
    chosen = rng.choice(VICTIMS)
    return Trial(seed, victim or chosen, rng.randint(1, LAST_KILL_UPDATE), rng.uniform(0.0, KILL_WITHIN_S))


@pytest.mark.slow
@pytest.mark.parametrize("victim", [pytest.param("trainer", marks=pytest.mark.long), "driver"])
def test_a_killed_trainer_or_driver_leaves_a_whole_run(tmp_path, victim):
    trial = run_trial(tmp_path, trial_of(seed=1, victim=victim))
    assert trial.killed


@pytest.mark.chaos
def test_chaos_trials(tmp_path):
    first = int(os.environ.get("DORA_CHAOS_SEED", "0"))
    trials = [run_trial(tmp_path, trial_of(seed))
              for seed in range(first, first + int(os.environ.get("DORA_CHAOS_TRIALS", "6")))]
    print("\nchaos trials: " + "; ".join(f"seed {t.seed} {t.victim} after update {t.after_updates} +{t.delay_s:.2f}s "
                                         f"{'killed' if t.killed else 'finished first'}"
                                         f"{', resumed' if t.resumed else ''}" for t in trials))
    assert all(t.killed for t in trials)
